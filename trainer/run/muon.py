"""optim.name=muon: torch's Muon for the hidden weight matrices and AdamW for the rest (the embeddings, the LM head,
vectors, and tensors of other ranks such as fused 3-D experts; Muon orthogonalises 2-D updates only), as one torch
Optimizer. One list of param groups, so the lr schedule reaches both; one state, so checkpoints, DCP's optimizer
state dict and the memory report see one optimizer. Muon's lr is scaled to AdamW's update RMS per matrix
(torch's adjust_lr_fn="match_rms_adamw", Moonlight's recipe), so one optim.lr serves both parts."""
from __future__ import annotations

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    def __init__(self, muon: torch.optim.Optimizer | None, adamw: torch.optim.Optimizer | None):
        self.parts = [part for part in (muon, adamw) if part is not None]
        super().__init__([group for part in self.parts for group in part.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Each part steps its own slice of this optimizer's param groups, on this optimizer's state."""
        start = 0
        for part in self.parts:
            count = len(part.param_groups)
            part.param_groups = self.param_groups[start:start + count]
            part.state = self.state
            start += count

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if "parts" in self.__dict__:  # load_state_dict replaced the groups and the state
            self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss


def build_muon(o, matrices, adamw_groups, adamw_kernel: dict) -> MuonWithAdamW:
    """Muon over `matrices` (weight decay o.weight_decay, momentum o.momentum, Nesterov o.nesterov), AdamW over
    `adamw_groups` (o.betas, o.eps, its kernel)."""
    muon = torch.optim.Muon([{"params": matrices, "weight_decay": o.weight_decay, "decays": True}], lr=o.lr,
                            momentum=o.momentum, nesterov=o.nesterov,
                            adjust_lr_fn="match_rms_adamw") if matrices else None
    adamw = torch.optim.AdamW(adamw_groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                              **adamw_kernel) if adamw_groups else None
    if muon is None and adamw is None:
        raise ValueError("optim.name=muon: no trainable parameters")
    return MuonWithAdamW(muon, adamw)
