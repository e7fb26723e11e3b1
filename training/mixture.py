"""--data_mix's train loader (docs/data.md, "Mixtures, annealing and epochs")."""

from pathlib import Path

import numpy as np
import torch

from dataloader import DistributedDataLoader, ReadAhead
from training.errors import UserError

MIX_STREAM = 0x6D6978  # ("mix") keeps the draws' seeds apart from the shuffles' ([seed, epoch], [seed, epoch, shard])


def source_names(sources: tuple[str, ...]) -> dict[str, str]:
    """{source: its name in the validation's keys}: the directory's last part, or the whole path where two share it."""
    names = [Path(source).name for source in sources]
    return {source: name if names.count(name) == 1 else source for source, name in zip(sources, names)}


class MixtureLoader(ReadAhead):
    """The train loader of a mixture: the run's j-th chunk (j counted over every rank and step) comes from the source
    that np.random.default_rng([seed, MIX_STREAM, j]) draws against the weights of the phase of its step (anneal from
    anneal_step on). Every rank advances every source past every chunk and reads its own, so the sources' positions,
    and the chunks a step trains on, are the same for any number of ranks."""

    def __init__(self, sources: list[DistributedDataLoader], weights: tuple[float, ...],
                 anneal_weights: tuple[float, ...] | None, anneal_step: int | None, seed: int):
        self.sources, self.seed, self.anneal_step = sources, seed, anneal_step
        self.rank, self.world_size, self.tokenizer = sources[0].rank, sources[0].world_size, sources[0].tokenizer
        self.chunks_per_step, self.B, self.T = sources[0].chunks_per_step, sources[0].B, sources[0].T
        self.bounds = [np.cumsum(w) for w in (weights, anneal_weights or weights)]
        self.chunk = 0  # chunks the run has read, on every rank together
        self.chunks_read = [0] * len(sources)
        self._forget_read_ahead()

    def source_of(self, chunk: int) -> int:
        annealing = self.anneal_step is not None and chunk // self.chunks_per_step >= self.anneal_step
        bounds = self.bounds[annealing]
        draw = np.random.default_rng([self.seed, MIX_STREAM, chunk]).random() * bounds[-1]
        return int(np.searchsorted(bounds, draw, side="right"))

    def _read_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's chunk of the next micro-step; the other ranks' chunks are passed over in their sources."""
        for k in range(self.world_size):
            i = self.source_of(self.chunk)
            if k == self.rank:
                batch = self.sources[i].read_chunk()
            self.sources[i].advance(1)
            self.chunks_read[i] += 1
            self.chunk += 1
        return batch

    def check_unchanged(self) -> None:  # (DistributedDataLoader.check_unchanged's, of every source)
        for source in self.sources:
            source.check_unchanged()

    def where(self) -> str:
        return f"chunk {self.chunk}; " + "; ".join(f"{s.data_dir}: {s.where()}" for s in self.sources)

    def tokens_by_source(self, steps: int) -> dict[str, int]:  # (steps: the plain loader's way to count; ours reads)
        return {s.data_dir: n * self.B * self.T for s, n in zip(self.sources, self.chunks_read)}

    def _state_dict(self) -> dict:
        return {"chunk": self.chunk, "chunks_read": list(self.chunks_read),
                "sources": [source.state_dict() for source in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        theirs = [source["data_dir"] for source in state.get("sources", [state])]  # (a plain run's: one)
        mine = [source.data_dir for source in self.sources]
        if "sources" not in state or theirs != mine:
            raise UserError(f"cannot resume the data loader: the snapshot's run trained on {', '.join(theirs)}"
                            f"{'' if 'sources' in state else ' (--data_dir)'}, this one on the --data_mix sources "
                            f"{', '.join(mine)}. Name the same sources in the same order (their weights may change), "
                            "or start a new run from the snapshot's weights with --init_from SNAPSHOT.")
        for source, position in zip(self.sources, state["sources"]):
            source.load_state_dict(position, whole_steps=False)
        self.chunk, self.chunks_read = state["chunk"], list(state["chunks_read"])
        self._forget_read_ahead()
