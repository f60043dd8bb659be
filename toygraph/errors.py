"""One exception family for everything toygraph raises on bad input or bad state."""


class ToygraphError(Exception):
    """Base of every error toygraph raises deliberately."""


class GraphError(ToygraphError):
    """A graph was built or used wrongly: shapes, dtypes, roles, uploads."""


class GGUFError(ToygraphError):
    """A GGUF file is missing, corrupt, or holds something toygraph cannot use."""


class DataError(ToygraphError):
    """A dataset, adapter or checkpoint file is malformed."""


class CudaError(ToygraphError):
    """A CUDA driver or NVRTC call failed."""


class SettingError(ToygraphError):
    """An environment variable of toygraph/environment.py has a malformed value."""
