"""Every op family's CUDA lowering (toygraph/ops/<family>/cuda.py), loaded by the CUDA runtime.

Importing a family's cuda.py enters its ``@lowers`` entries in the lowering registry and
declares its kernel files; the runtime (this package) loads them all here, in the order of
the families in toygraph/ops/__init__.py, which is the order their kernel files are
compiled in. The graph core never imports this: it knows no backend.
"""
# isort: off
import toygraph.ops.shape.cuda  # noqa: F401
import toygraph.ops.elementwise.cuda  # noqa: F401
import toygraph.ops.gated.cuda  # noqa: F401
import toygraph.ops.norm.cuda  # noqa: F401
import toygraph.ops.rotary.cuda  # noqa: F401
import toygraph.ops.flash_attention.cuda  # noqa: F401
import toygraph.ops.gemm.cuda  # noqa: F401
import toygraph.ops.rows.cuda  # noqa: F401
import toygraph.ops.loss.cuda  # noqa: F401
import toygraph.ops.update.cuda  # noqa: F401
import toygraph.ops.collective.cuda  # noqa: F401
import toygraph.ops.cache.cuda  # noqa: F401
import toygraph.ops.deltanet.cuda  # noqa: F401
import toygraph.ops.slicing.cuda  # noqa: F401
import toygraph.ops.preference.cuda  # noqa: F401
import toygraph.ops.experts.cuda  # noqa: F401
import toygraph.ops.policy.cuda  # noqa: F401
import toygraph.ops.stochastic.cuda  # noqa: F401
# isort: on
