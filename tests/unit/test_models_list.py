"""``servetune models list``: what plan, init and run know offline (the catalogue, the store of ``models add``)
and the tiny test models servetune builds."""

from __future__ import annotations

import servetune.cli as cli
from servetune.capacity.arch import load_catalog
from servetune.models.tinyarch import TINY_ARCHS


def _listed(capsys, monkeypatch, home) -> dict[str, list[str]]:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HOME", str(home))
    assert cli.main(["models", "list"]) == 0
    sections: dict[str, list[str]] = {}
    head = ""
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  "):
            sections[head].append(line.split()[0])
        else:
            head = line.split(" (")[0].split(":")[0]
            sections[head] = []
    return sections


def test_every_catalogue_model_and_tiny_model_is_listed(capsys, monkeypatch, tmp_path) -> None:
    sections = _listed(capsys, monkeypatch, tmp_path)
    assert sorted(sections["catalogue"]) == sorted(load_catalog())
    assert sections["tiny test models servetune builds"] == ["tiny", *TINY_ARCHS]
    assert sections["kept by `servetune models add`"] == []


def test_models_kept_by_add_are_listed_by_hub_id(capsys, monkeypatch, tmp_path) -> None:
    store = tmp_path / "servetune" / "models"
    store.mkdir(parents=True)
    (store / "google--gemma-3-4b-it.json").write_text("{}")
    (store / "openai--gpt-oss-20b.json").write_text("{}")
    sections = _listed(capsys, monkeypatch, tmp_path)
    assert sections["kept by `servetune models add`"] == ["google/gemma-3-4b-it", "openai/gpt-oss-20b"]
