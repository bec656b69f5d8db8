"""Containers that register the Modules they hold: ModuleList (by index) and ModuleDict (by key)."""
from minidist.nn.module import Module


class ModuleList(Module):
    """A list of Modules named "0", "1", ... (so parameters read ``h.0.attn.c_attn.weight``)."""

    def __init__(self, modules=()):
        super().__init__()
        for module in modules:
            self.append(module)

    def append(self, module: Module):
        setattr(self, str(len(self._modules)), module)

    def __getitem__(self, i):
        items = list(self._modules.values())
        return ModuleList(items[i]) if isinstance(i, slice) else items[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ModuleDict(Module):
    """Modules registered under the given keys, reachable as attributes (``transformer.wte``)."""

    def __init__(self, modules: dict):
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)

    def __getitem__(self, name):
        return self._modules[name]
