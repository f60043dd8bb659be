"""The kernel files and kernel names the tests check against, derived as the backends
derive them: from the files the op families declare (toygraph/ops/lowering/sources.py)."""
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops  # noqa: F401
from toygraph.ops.lowering.registry import op_kernels
from toygraph.ops.lowering.sources import (backend_source, files_of, kernel_names, module_source,
                                           only_in)

#: The f32 module's files, and the tensor-core files the bf16/tf32 modules add.
FAMILIES = files_of("f32")
TC_FAMILIES = only_in("bf16")
#: Every kernel of the f32 module, and of the tensor-core files.
KERNEL_NAMES = tuple(kernel_names(backend_source("f32")))
#: (module_source also places the f32 files the tensor-core files need, e.g.
#: flash_attention.cu for tc_attention.cu: their kernels are the f32 module's.)
TC_KERNEL_NAMES = tuple(k for k in kernel_names(module_source(TC_FAMILIES))
                        if k not in KERNEL_NAMES)
#: The kernels each op's lowering declares.
OP_KERNELS = op_kernels()
