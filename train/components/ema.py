"""--model-ema: an exponential moving average of the weights, torchvision's reference recipe.

torch's AveragedModel with torch's EMA function (get_ema_multi_avg_fn), buffers included (BatchNorm
statistics are averaged too), updated every --model-ema-steps optimizer steps of an epoch and restarted
from the weights during the warm-up, with the reference's decay adjustment. Its one change: the count of
updates is kept on the host as well, so that an update never waits for the device (AveragedModel reads its
device-side count to choose between copying and averaging)."""

from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from train.config.settings import Regularisation


def adjusted_decay(reg: Regularisation, global_batch: int, epochs: float) -> float:
    """torchvision's adjustment, which keeps the average's horizon independent of the batch, the world size,
    the update period and the run's length: alpha = (1 - decay) x world x batch x period / epochs, at most 1
    (global_batch: world x batch x --grad-accum)."""
    adjust = global_batch * reg.model_ema_steps / epochs
    return 1.0 - min(1.0, (1.0 - reg.model_ema_decay) * adjust)


class ModelEma(AveragedModel):
    def __init__(self, model: torch.nn.Module, decay: float, device: torch.device):
        super().__init__(model, device=device, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.decay, self.updates = decay, 0

    def restart(self) -> None:
        """The next update copies the weights (the reference resets the count during the warm-up)."""
        self.n_averaged.fill_(0)
        self.updates = 0

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        """AveragedModel.update_parameters with use_buffers and a multi_avg_fn, without reading the device."""
        ema = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.updates == 0:
            for a, m in zip(ema, current, strict=True):
                a.detach().copy_(m)
        else:
            groups: dict[tuple, tuple[list, list]] = {}
            for a, m in zip(ema, current, strict=True):
                pair = groups.setdefault((a.device, a.dtype), ([], []))
                pair[0].append(a.detach())
                pair[1].append(m)
            for averaged, model_tensors in groups.values():
                self.multi_avg_fn(averaged, model_tensors, None)
        self.n_averaged += 1
        self.updates += 1

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.updates = int(self.n_averaged)  # once, at a resume
        return result
