"""Every op family's CPU engine replay (toygraph/ops/<family>/cpu.py), loaded by the numpy
backend when it replays runs of nodes in the engine (``TOYGRAPH_CPU_REPLAY=engine``).

Importing a family's cpu.py enters its ``@replays`` entries in toygraph.cpu.replay.REPLAYS;
its kernels (cpu.h beside it) are built into the engine whatever is imported.
"""
# isort: off
import toygraph.ops.elementwise.cpu  # noqa: F401
import toygraph.ops.gated.cpu  # noqa: F401
import toygraph.ops.norm.cpu  # noqa: F401
import toygraph.ops.rotary.cpu  # noqa: F401
import toygraph.ops.flash_attention.cpu  # noqa: F401
import toygraph.ops.gemm.cpu  # noqa: F401
import toygraph.ops.rows.cpu  # noqa: F401
import toygraph.ops.loss.cpu  # noqa: F401
import toygraph.ops.update.cpu  # noqa: F401
import toygraph.ops.cache.cpu  # noqa: F401
import toygraph.ops.shape.cpu  # noqa: F401
import toygraph.ops.slicing.cpu  # noqa: F401
import toygraph.ops.preference.cpu  # noqa: F401
import toygraph.ops.policy.cpu  # noqa: F401
import toygraph.ops.stochastic.cpu  # noqa: F401
import toygraph.ops.experts.cpu  # noqa: F401
import toygraph.ops.deltanet.cpu  # noqa: F401
# isort: on
