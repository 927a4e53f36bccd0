"""The parallel layout of a run: degrees, their validation, and this rank's coordinates.

Mesh axes are named (pp, dp, tp) with tp fastest, matching hpcscale.topology.placement's rank order:
    rank = (pp_index * dp + dp_index) * tp + tp_index
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcscale.errors import BadInput


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    pp: int
    dp: int
    tp: int

    @classmethod
    def for_world(cls, *, world_size: int, tp: int, pp: int) -> ParallelDims:
        """dp derived from the world size; the error names every factor."""
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise BadInput(f"tp({tp}) * pp({pp}) = {tp * pp} does not divide WORLD_SIZE({world_size})")
        return cls(pp=pp, dp=world_size // (tp * pp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_index, dp_index, tp_index) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp
