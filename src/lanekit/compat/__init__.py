"""Compatibility packages: lanekit under another library's import names, opt in.

:mod:`lanekit.compat.flash_attn` is FlashAttention 2's Python API (``flash_attn``,
``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``, ``flash_attn.layers.rotary``)
on lanekit's kernels. :func:`install` makes ``import flash_attn`` (and ``import
flash_attn.<submodule>``) resolve to it, for code that imports FlashAttention directly, e.g. on
GPUs where FlashAttention does not build (AMD RDNA); :func:`uninstall` undoes that. Nothing is
installed by importing lanekit or this package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

_ALIAS = "flash_attn"
_TARGET = "lanekit.compat.flash_attn"


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system an already-imported lanekit module under the alias's name."""

    def __init__(self, module):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec   # the import system set the alias's spec; the module keeps its own


class _AliasFinder(importlib.abc.MetaPathFinder):
    """``flash_attn`` and ``flash_attn.X.Y`` -> ``lanekit.compat.flash_attn`` and its ``X.Y``; a
    submodule lanekit does not provide is not found (an ImportError, as for any missing module)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _ALIAS and not fullname.startswith(_ALIAS + "."):
            return None
        try:
            module = importlib.import_module(_TARGET + fullname[len(_ALIAS):])
        except ModuleNotFoundError:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module),
                                              is_package=hasattr(module, "__path__"))


_FINDER = _AliasFinder()


def _aliased(name: str) -> bool:
    return name == _ALIAS or name.startswith(_ALIAS + ".")


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _FINDER in sys.meta_path


def install() -> None:
    """Make ``import flash_attn`` and ``import flash_attn.<submodule>`` give lanekit's
    FlashAttention-2 API (:mod:`lanekit.compat.flash_attn`) from now on in this process, ahead of
    an installed FlashAttention. Idempotent.

    Raises:
        RuntimeError: a real ``flash_attn`` is already imported in this process (modules holding
            its functions would keep them); install before the first ``import flash_attn``.
    """
    if installed():
        return
    real = sorted(n for n, m in sys.modules.items()
                  if _aliased(n) and not getattr(m, "__name__", "").startswith(_TARGET))
    if real:
        raise RuntimeError(f"lanekit.compat.install: expected flash_attn not yet imported, got {real[:4]} "
                           "already in sys.modules; call install() before the first import of flash_attn")
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Undo :func:`install`: ``import flash_attn`` finds the installed FlashAttention again (or
    nothing). The alias's entries leave ``sys.modules``; modules that already imported names from
    it keep them. Idempotent."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n, m in sys.modules.items()
                 if _aliased(n) and getattr(m, "__name__", "").startswith(_TARGET)]:
        del sys.modules[name]


__all__ = ["install", "installed", "uninstall"]
