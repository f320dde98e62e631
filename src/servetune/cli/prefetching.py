"""``--no-prefetch`` of the commands that start a study's point again (``verify``, ``serve-check``, ``recheck``): its
hub model's weights fetched where its engine runs, before it starts (servetune/prefetch.py ``prefetch_point``), so a
first start on a machine or a cluster does not count the download inside its start-up clock. Each command keeps
the records (``prefetch``) in the file it writes, apart from the engine's ``startup_s``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from servetune.results import WeightsPrefetch
    from servetune.trial.runner import TrialSpec

HELP = ("do not download the model's weights where its engine runs before it starts (the engine then downloads them "
        "inside its start-up)")  # fmt: skip


def add_no_prefetch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-prefetch", action="store_true", help=HELP)


@dataclass
class PointPrefetch:
    """Fetches each model once per place (this machine, or the Ray cluster's nodes of a GPU type) and keeps the records.
    ``spinner``: show a spinner while it runs (off where the caller's own is on: rich runs one at a time)."""

    console: Console
    spinner: bool = True
    records: list[WeightsPrefetch] = field(default_factory=list)
    done: set[tuple[str, bool, str | None]] = field(default_factory=set)

    def __call__(self, model: str, env: Mapping[str, str], engine_args: Mapping[str, Any], device: str,
                 through_ray: bool, gpu_type: str | None = None) -> None:  # fmt: skip
        from servetune.prefetch import prefetch_point

        place = (model, through_ray, gpu_type if through_ray else None)
        if place in self.done:
            return
        self.done.add(place)

        def say(line: str) -> None:
            self.console.print(line, soft_wrap=True, highlight=False, markup=False)

        if not self.spinner:
            self.records += prefetch_point(model, env, engine_args, device, say, through_ray, gpu_type)
            return
        with self.console.status("prefetching weights") as status:
            self.records += prefetch_point(model, env, engine_args, device, say, through_ray, gpu_type,
                                           status=status.update)  # fmt: skip

    def spec(self, spec: TrialSpec, through_ray: bool) -> None:
        """A trial's engine, as verify and recheck start it again (verify/run.py ``Prefetch``)."""
        self(spec.model, spec.env, spec.engine_args, spec.device, through_ray, spec.gpu_type)

    def dumped(self) -> list[dict[str, Any]]:
        return [r.model_dump(mode="json") for r in self.records]
