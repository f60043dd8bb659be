"""The policy family's engine replay (cpu.h beside this): clipped_surrogate(+back) and
kl_penalty(+back) on f32 arrays of one shape."""
from __future__ import annotations

from toygraph.ops.elementwise.cpu import elementwise_replays

elementwise_replays(["clipped_surrogate", "clipped_surrogate_back"],
                    lambda attrs: (attrs["lo"], attrs["hi"]))
elementwise_replays(["kl_penalty", "kl_penalty_back"])
