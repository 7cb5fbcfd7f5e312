"""A decoder layer's input norm taken by the layer before it (the fast tier's decode steps).

With the stage `Fusion.norm_out`, a layer step's last launch (the MLP's down projection and its
residual) can also write what the next layer's input projections need to take its input norm themselves
(`Fusion.prenormed`): the residual stream h times that norm's weight, and the launch blocks' parts of the
sums of squares of h. A step returns h to the model's loop as before; the parts go beside it, through a
`NormSlot` the layers of one list share. The next step takes them only when its input is that same h
(the array the loop passed on) and its norm the one they were made for, so a layer the loop skipped, a
batch built in between or a prompt chunk (whose layers run their own path) never read parts that are not
theirs: those steps take their norm as a launch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn


@dataclass
class NormSlot:
    """What the last layer step handed on: the h it returned, the norm it took, (h * weight, parts)."""

    h: mx.array | None = None
    norm: nn.Module | None = None
    parts: tuple[mx.array, ...] = ()


@dataclass(frozen=True)
class LayerLink:
    """A layer step's place in its list: the slot its list shares, its own input norm and the next layer's
    (None: the last layer, whose output goes to the model's final norm). The default links nothing."""

    slot: NormSlot = field(default_factory=NormSlot)
    norm: nn.Module | None = None
    next_norm: nn.Module | None = None

    def take(self, x: mx.array) -> tuple[mx.array, ...]:
        """(x * this layer's norm weight, the parts of x's sums of squares) where the layer before left them
        for this x and this norm, else (); the slot is emptied either way."""
        s = self.slot
        parts = s.parts if self.norm is not None and s.h is x and s.norm is self.norm else ()
        s.h, s.norm, s.parts = None, None, ()
        return parts

    def pass_on(self, outputs: tuple[mx.array, ...]) -> mx.array:
        """The step's h from `layer_launches.residual_mlp`'s results ((h,) or (h, hw, ssq)), leaving hw and
        ssq for the next layer's step."""
        if len(outputs) == 3:
            self.slot.h, self.slot.norm, self.slot.parts = outputs[0], self.next_norm, outputs[1:]
        return outputs[0]


def layer_links(model: nn.Module) -> dict[int, LayerLink]:
    """Each decoder layer's link, by id: the layers of one list (a module's `layers`) share a slot, and
    each takes the next one's input norm."""
    links = {}
    for _, module in model.named_modules():
        layers = module.get("layers") if isinstance(module, dict) else None
        if not isinstance(layers, list):
            continue
        norms = [getattr(layer, "input_layernorm", None) for layer in layers]
        slot = NormSlot()
        for layer, norm, next_norm in zip(layers, norms, norms[1:] + [None]):
            links[id(layer)] = LayerLink(slot, norm, next_norm)
    return links
