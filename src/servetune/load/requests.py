"""Turn a workload into a deterministic stream of requests with exact token counts.

Prompts are made of "clean" pieces of the served model's vocabulary: whole words with a
leading space where the vocabulary has them (they re-tokenize to themselves, so counts stay
exact across joins), else single printable characters (byte-level tokenizers). A workload with
``text: corpus`` or a text file of its own has its prompts cut from that text instead, each from a
random place (n-gram speculation and a real tokenizer then see text that behaves like text). Each
prompt is checked by encoding it and trimmed or extended until its count is exact.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from servetune.config.asks import Structured
from servetune.config.workload import Empirical, Workload
from servetune.load.images import ImagePart, make_image

_WORD = re.compile(r" [A-Za-z]{2,12}")
_CHAR = re.compile(r"[ -~]")


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the request stream uses."""

    @property
    def all_special_ids(self) -> list[int]: ...

    def __len__(self) -> int: ...
    def encode(self, text: str, /, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int], /) -> str: ...
    def batch_decode(self, ids: list[list[int]], /) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    prompt: str
    input_tokens: int
    output_tokens: int
    request_class: str
    session: int | None = None  # the conversation this turn belongs to (workloads with sessions)
    turn: int = 0
    think_s: float = 0.0  # seconds to wait after the previous turn's answer before sending
    reused_tokens: int = 0  # of input_tokens, those an earlier prompt began with (what a prefix cache can hit)
    sampling: tuple[
        tuple[str, object], ...
    ] = ()  # its class's sampling fields, sent in the body (Workload.sampling_of)
    structured: Structured | None = None  # the structured output it asks for: the client checks the answer
    model: str | None = None  # the LoRA adapter it names as its model (workload adapters); None: the served model
    images: tuple[ImagePart, ...] = ()  # the images it carries after its text (workload images; chat only)


class PromptFactory:
    """Makes text of an exact number of tokens for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        ids = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids])
        words = [i for i, t in zip(ids, texts, strict=True) if _WORD.fullmatch(t) and self.count(t) == 1]
        chars = [i for i, t in zip(ids, texts, strict=True) if _CHAR.fullmatch(t) and self.count(t) == 1]
        self.pool = np.asarray(words if len(words) >= 500 else chars, dtype=np.int64)
        if not len(self.pool):
            raise ValueError("the tokenizer has no plain-text tokens to build prompts from")
        self._encoded: dict[str, np.ndarray] = {}  # source texts as token ids, each encoded once

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, n_tokens: int, rng: np.random.Generator, prefix: str = "") -> str:
        """``prefix`` followed by random pieces, ``n_tokens`` tokens in all (prefix included)."""
        if n_tokens <= 0:
            return prefix
        need = n_tokens - (self.count(prefix) if prefix else 0)
        ids = list(rng.choice(self.pool, size=max(need, 0)))
        text = prefix + self.tokenizer.decode(ids)
        for _ in range(16):
            have = self.count(text)
            if have == n_tokens:
                return text
            if have > n_tokens:
                ids = ids[: max(len(ids) - (have - n_tokens), 0)]
            else:
                ids += list(rng.choice(self.pool, size=n_tokens - have))
            text = prefix + self.tokenizer.decode(ids)
        return text  # close enough; the server's usage reports the real count

    def passage(self, source: str, n_tokens: int, rng: np.random.Generator, prefix: str = "") -> str:
        """``prefix`` followed by a passage of ``source`` that starts at a random token, ``n_tokens`` tokens in
        all (prefix included); a passage longer than what is left of ``source`` wraps around to its start."""
        if n_tokens <= 0:
            return prefix
        ids = self._encoded.get(source)
        if ids is None:
            ids = self._encoded[source] = np.asarray(self.tokenizer.encode(source, add_special_tokens=False))
        start = int(rng.integers(0, len(ids)))

        def cut(length: int) -> str:
            return prefix + self.tokenizer.decode(np.take(ids, np.arange(start, start + length), mode="wrap").tolist())

        length = max(n_tokens - (self.count(prefix) if prefix else 0), 0)
        text = cut(length)
        for _ in range(16):
            have = self.count(text)
            if have == n_tokens:
                return text
            length = max(length - (have - n_tokens), 0)
            text = cut(length)
        return text  # close enough; the server's usage reports the real count


#: Makes text of a number of tokens: (tokens, rng, prefix) -> text.
TextMaker = Callable[..., str]


def text_maker(workload: Workload, prompts: PromptFactory) -> TextMaker:
    """How a workload's prompts are made: passages of its text (``text: corpus`` or a file), else random words."""
    source = workload.source_text
    if source is None:
        return prompts.text

    def passage(n_tokens: int, rng: np.random.Generator, prefix: str = "") -> str:
        return prompts.passage(source, n_tokens, rng, prefix=prefix)

    return passage


def iter_requests(workload: Workload, prompts: PromptFactory, stream: int = 0) -> Iterator[RequestSpec]:
    """An endless, deterministic stream of requests.

    ``stream`` separates independent streams of the same workload (warm-up, each load level),
    so a level never replays prompts an earlier level left in the prefix cache. With
    ``sessions``, a conversation's turns come one after the other, numbered by ``session``.
    """
    rng = np.random.default_rng([workload.seed, stream])
    if workload.sessions is not None:
        yield from _conversations(workload, prompts, rng, stream)
        return
    draw = _Draw(workload, prompts, stream)
    index = 0
    while True:
        text, n_in, n_out, name, reused = draw.first(rng)
        yield RequestSpec(
            index=index, prompt=text, input_tokens=n_in, output_tokens=n_out, request_class=name, reused_tokens=reused,
            sampling=draw.sampling[name], structured=draw.structured[name], model=draw.adapter(),
            images=draw.images(name),
        )  # fmt: skip
        index += 1


class _Draw:
    """Draws one request of a workload: its class, lengths, shared prefix and prompt."""

    def __init__(self, workload: Workload, prompts: PromptFactory, stream: int = 0) -> None:
        self.workload, self.prompts = workload, prompts
        # Adapters are drawn from a generator of their own: a workload's lengths and prompts stay as they were.
        self.adapter_rng = np.random.default_rng([workload.seed, stream, 1])
        self.adapter_names = [a.name for a in workload.adapters]
        adapter_weights = np.asarray([a.weight for a in workload.adapters], dtype=float)
        self.adapter_weights = adapter_weights / adapter_weights.sum() if len(adapter_weights) else adapter_weights
        self.text = text_maker(workload, prompts)
        self.classes = workload.classes
        # Images too: their own generator, so a workload's requests stay as they were beside them.
        self.image_rng = np.random.default_rng([workload.seed, stream, 2])
        self.image_specs = {c.name: workload.images_of(c) for c in self.classes}
        self.sampling = {c.name: tuple(workload.sampling_of(c).items()) for c in self.classes}
        self.structured = {c.name: workload.structured_of(c) for c in self.classes}
        weights = np.asarray([c.weight for c in self.classes], dtype=float)
        self.weights = weights / weights.sum()
        self.prefix_texts: list[str] = []
        self.prefix_weights = None
        if workload.shared_prefix:
            # The shared prefixes are the same in every stream: they are what the prefix cache reuses.
            prefix_rng = np.random.default_rng([workload.seed, 2**31 - 1])
            self.prefix_texts = [
                self.text(workload.shared_prefix.tokens, prefix_rng) for _ in range(workload.shared_prefix.groups)
            ]
            self.prefix_weights = workload.shared_prefix.group_weights()

    def adapter(self) -> str | None:
        """The LoRA adapter the next request (conversation) names, drawn by weight; None without adapters."""
        names = self.adapter_names
        if len(names) <= 1:
            return names[0] if names else None
        return names[int(self.adapter_rng.choice(len(names), p=self.adapter_weights))]

    def images(self, name: str) -> tuple[ImagePart, ...]:
        """The images the next request (conversation) of class ``name`` carries, each from its own seed."""
        spec = self.image_specs.get(name)
        if spec is None:
            return ()
        rng = self.image_rng
        out = []
        for _ in range(spec.draw_count(rng)):
            size = spec.draw_size(rng)
            seed = int(rng.integers(0, 2**63 - 1))
            out.append(make_image(size.width, size.height, seed, spec.format, spec.detail))
        return tuple(out)

    def request_class(self, rng: np.random.Generator):
        classes = self.classes
        return classes[int(rng.choice(len(classes), p=self.weights))] if len(classes) > 1 else classes[0]

    def first(self, rng: np.random.Generator) -> tuple[str, int, int, str, int]:
        """A request on its own (or a conversation's first turn): prompt, input and output tokens, class,
        and the shared prefix's tokens when it starts with it."""
        workload, prompts = self.workload, self.prompts
        cls = self.request_class(rng)
        n_out = int(cls.output_tokens.sample(rng, 1)[0])
        shared = workload.shared_prefix
        prefix, prefix_tokens = "", 0
        if shared is not None and rng.random() < shared.fraction:
            # one prefix: no draw, so a one-prefix workload's requests stay as they were
            k = int(rng.choice(len(self.prefix_texts), p=self.prefix_weights)) if len(self.prefix_texts) > 1 else 0
            prefix, prefix_tokens = self.prefix_texts[k], shared.tokens
        if isinstance(cls.input_tokens, Empirical) and cls.input_tokens.prompts is not None:
            text = prefix + cls.input_tokens.prompts[int(cls.input_tokens.sample_indices(rng, 1)[0])]
            n_in = prompts.count(text)
        else:
            n_in = int(cls.input_tokens.sample(rng, 1)[0])
            if prefix:
                n_in = max(n_in, prefix_tokens + 1)
            text = self.text(n_in, rng, prefix=prefix)
        return text, n_in, n_out, cls.name, prefix_tokens if prefix else 0

    def next_turn(self, rng: np.random.Generator, cls_name: str, history: str) -> tuple[str, int, int]:
        """A later turn: ``history`` followed by a new message (the sessions' lengths, else the class's)."""
        cls = next((c for c in self.classes if c.name == cls_name), self.classes[0])
        sessions = self.workload.sessions
        message = (sessions.input_tokens if sessions is not None else None) or cls.input_tokens
        answer = (sessions.output_tokens if sessions is not None else None) or cls.output_tokens
        n_out = int(answer.sample(rng, 1)[0])
        if isinstance(message, Empirical) and message.prompts is not None:
            text = history + message.prompts[int(message.sample_indices(rng, 1)[0])]
            return text, self.prompts.count(text), n_out
        n_new = int(message.sample(rng, 1)[0])
        n_in = self.prompts.count(history) + n_new
        return self.text(n_in, rng, prefix=history), n_in, n_out


def _conversations(
    workload: Workload, prompts: PromptFactory, rng: np.random.Generator, stream: int = 0
) -> Iterator[RequestSpec]:
    sessions = workload.sessions
    assert sessions is not None
    draw = _Draw(workload, prompts, stream)
    limit = sessions.max_context_tokens
    index = session = 0
    while True:
        turns = max(1, int(sessions.turns.sample(rng, 1)[0]))
        text, n_in, n_out, name, reused = draw.first(rng)
        adapter = draw.adapter()  # a conversation keeps its adapter
        images = draw.images(name)  # and its images: every turn sends the conversation so far
        yield RequestSpec(
            index, text, n_in, n_out, name, session=session, turn=0, reused_tokens=reused, sampling=draw.sampling[name],
            structured=draw.structured[name], model=adapter, images=images,
        )  # fmt: skip
        index += 1
        for turn in range(1, turns):
            # The answer as the conversation carries it: text of the answer's length.
            history = draw.text(n_in + n_out, rng, prefix=text)
            reused = n_in  # the previous prompt (the answer here is servetune's text, not the model's)
            text, n_in, n_out = draw.next_turn(rng, name, history)
            if limit is not None and n_in + n_out > limit:
                break
            think = float(sessions.think_time_s.sample(rng, 1)[0])
            yield RequestSpec(
                index, text, n_in, n_out, name, session=session, turn=turn, think_s=think, reused_tokens=reused,
                sampling=draw.sampling[name], structured=draw.structured[name], model=adapter, images=images,
            )  # fmt: skip
            index += 1
        session += 1
