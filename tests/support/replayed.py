"""Which engine kernels the CPU backend's plans replay: a spy on its compile step."""


def replayed_kernels(monkeypatch) -> list:
    """A list that collects, from now on, the kernel of every engine call in every plan the
    CPU backend compiles (numpy kernels left out)."""
    from toygraph.core import numpy_backend
    kernels = []
    plain = numpy_backend.CpuBackend._compile

    def spy(self, nodes):
        steps = plain(self, nodes)
        kernels.extend(k for op, prog, *_ in steps if op is None for k in prog.kernels)
        return steps

    monkeypatch.setattr(numpy_backend.CpuBackend, "_compile", spy)
    return kernels
