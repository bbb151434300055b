"""TRITON_INTERPRET=1 on numpy >= 2.4: triton 3.6's interpreter takes int() of 1-element
arrays for values read from memory (triton-lang/triton#9171); `patch()` squeezes first,
as the fix upstream does."""
from __future__ import annotations


def patch() -> None:
    from triton.runtime import interpreter as interp

    if getattr(interp, "_kvyard_index_patch", False):
        return
    orig = interp._patch_lang_tensor  # an AttributeError here: a triton whose interpreter moved on

    def _patch_lang_tensor(tensor, scope) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        scope.set_attr(tensor, "__bool__", lambda self: bool(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = _patch_lang_tensor
    interp._kvyard_index_patch = True
