"""Make methods fail when a compiled trace calls them: a test that says "formed once, outside the graph"."""

import torch


def refuse_while_compiling(monkeypatch, cls, names, where: str) -> None:
    """Patch each of `cls`'s methods `names` to raise `AssertionError` when called while `torch.compile` traces
    (`where` names the compiled code in the message); eager calls run the method as it is."""

    def guarded(real):
        def wrapped(self, *args):
            if torch.compiler.is_compiling():
                raise AssertionError(f"{real.__name__} formed inside the {where}")
            return real(self, *args)

        return wrapped

    for name in names:
        monkeypatch.setattr(cls, name, guarded(getattr(cls, name)))
