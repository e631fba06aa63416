"""How the model is spread over the workers (--parallel): one object a run holds, `spread_over(kind, world, device)`.

  Replicated   ddp: every worker holds the whole model, its gradients and its optimizer state; DDP (wrapped where the
               run is built for training) averages the gradients over the workers
  Sharded      fsdp: FSDP2's fully_shard on each block the task names (Task.blocks), then on the whole model, over a
               mesh of every worker (a CPU mesh under gloo): each worker holds 1/N of every parameter, gradient and
               optimizer state, and a block's parameters are gathered for its forward and again for its backward.
               Its own division of the gradients is turned off (averages False): the trainer scales the loss so that
               the gradient is the step's sum over its count, as under DDP. --precision bf16 is FSDP2's
               MixedPrecisionPolicy (bf16 parameters gathered, fp32 reduction into fp32 shards), not autocast.

Both give the whole state back in the format of the model's and the optimizer's own state_dict (model_state,
optimizer_state: rank 0 holds it), so a checkpoint is one file whatever the spread and any world size resumes it; and
load it into the model as it is spread (load_model, load_optimizer). Under FSDP each of these is a collective: every
rank calls it, rank 0 alone receives the state. Sharded also writes and reads each rank's shards alone, into and from
a folder (save_shards, load_shards: --checkpoint-format sharded, train/files/shards.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


class Replicated:
    """--parallel ddp: the model whole on every worker."""

    kind = "ddp"
    averages = True  # the reduction divides the workers' summed gradients by their number
    lockstep = False  # a forward is no collective: a rank may evaluate fewer batches than another

    def shard(self, model: torch.nn.Module, blocks: list[str]) -> torch.nn.Module:
        return model

    def autocast(self, dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype the forward autocasts to (None: off), given the precision's (--precision bf16/fp16)."""
        return dtype

    def micro_batch(self, model: torch.nn.Module, last: bool):
        """The context of a micro-batch's forward and backward: the gradients reduced on the step's last alone."""
        return contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync()

    def model_state(self, model: torch.nn.Module) -> dict:
        return model.state_dict()

    def load_model(self, model: torch.nn.Module, state: dict) -> None:
        model.load_state_dict(state)

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


class Sharded(Replicated):
    """--parallel fsdp: FSDP2 over every worker."""

    kind = "fsdp"
    averages = False  # set_gradient_divide_factor(1.0) on every sharded module: the workers' gradients summed
    lockstep = True  # every forward gathers parameters from every rank: each rank runs as many

    def __init__(self, world: int, device: torch.device, precision: str = "fp32"):
        self.world, self.device = world, device
        self.bf16 = precision == "bf16"  # FSDP2's MixedPrecisionPolicy: bf16 parameters, fp32 reduction

    def shard(self, model: torch.nn.Module, blocks: list[str]) -> torch.nn.Module:
        """fully_shard on each block (by its qualified name), then the root; the weights, made from the seed on the
        whole model before, are cut from it: the same at any world size."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if self.bf16 else {}
        for name in blocks:  # a block's output stays bf16 (the next block's input); the model's is float32 (the loss)
            fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))
        output = torch.float32 if self.bf16 else None
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=output))
        for module in model.modules():  # each sharded module reduces its own parameters' gradients: summed, and no more
            if isinstance(module, FSDPModule):  # (gloo has no AVG nor PREMUL_SUM, which FSDP picks for fp32 else)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def autocast(self, dtype: torch.dtype | None) -> torch.dtype | None:
        """bf16: none, the policy casts the gathered parameters itself."""
        return None if self.bf16 else dtype

    def micro_batch(self, model: torch.nn.Module, last: bool):
        model.set_requires_gradient_sync(last)  # FSDP2's own switch: DDP's no_sync() does not exist here
        return contextlib.nullcontext()

    def model_state(self, model: torch.nn.Module) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_whole(cpu_offload=True))

    def load_model(self, model: torch.nn.Module, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state, options=_whole())

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's whole state keyed as optimizer.state_dict() keys it (by position), on rank 0 ({} on the
        others): DCP's keys it by the parameters' names."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        named = get_optimizer_state_dict(model, optimizer, options=_whole(cpu_offload=True))
        if not named:
            return {}
        position = {name: i for i, name in enumerate(n for group in named["param_groups"] for n in group["params"])}
        # the groups as the optimizer keeps them (DCP's copy turns a tuple such as AdamW's betas into a list)
        return {"state": {position[name]: value for name, value in named["state"].items()},
                "param_groups": optimizer.state_dict()["param_groups"]}

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        names = {p: name for name, p in model.named_parameters()}
        order = [names[p] for group in optimizer.param_groups for p in group["params"]]
        named = {"state": {order[i]: value for i, value in state["state"].items()},
                 "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                                  for group in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, named, options=_whole())
        _groups_as_saved(optimizer, state["param_groups"])

    def save_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> list[str]:
        """Every rank together: its shards of the model and the optimizer (DCP's sharded state dicts, keyed by the
        parameters' names) into `folder`, by torch.distributed.checkpoint, nothing gathered. Returns the names of
        the files every rank wrote, DCP's index last, from DCP's own record of the save (the same on every rank, and
        no listing of a folder that other nodes wrote into)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        try:
            index = dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
        except dcp.CheckpointException as e:  # every rank raises it when any rank failed
            raise OSError(None, _first_failure(e)) from None
        return [*sorted({stored.relative_path for stored in index.storage_data.values()}), ".metadata"]

    def load_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                    param_groups: list[dict]) -> None:
        """Every rank together: this rank's shards of the model and the optimizer read from `folder` (saved at any
        number of workers: DCP reads the pieces each shard needs), the groups' settings as the optimizer kept them
        (`param_groups`, state.pt's)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)  # the shapes to read into (the optimizer's
        state = {"model": model_state, "optimizer": optimizer_state}  # state made by a step of zero gradients at lr 0)
        try:
            dcp.load(state, checkpoint_id=folder)
        except dcp.CheckpointException as e:  # a key or a shape the folder lacks: every rank raises it
            raise RuntimeError(_first_failure(e)) from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        _groups_as_saved(optimizer, param_groups)


def _first_failure(e: BaseException) -> str:
    """The first line of a DCP CheckpointException: its first failed rank's own exception's."""
    error = next(iter(e.failures.values()))[0]  # each rank's (exception, its traceback)
    return (getattr(error, "strerror", None) or str(error) or type(error).__name__).splitlines()[0]


def _groups_as_saved(optimizer: torch.optim.Optimizer, param_groups: list[dict]) -> None:
    """The groups' settings as optimizer.state_dict() gave them at the save (DCP's copy turns a tuple such as AdamW's
    betas into a list)."""
    for group, saved in zip(optimizer.param_groups, param_groups, strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})


def _whole(cpu_offload: bool = False):
    """DCP's options for the whole state: gathered (rank 0 alone keeps it, on the CPU) or given whole to every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def planned(kind: str, model: torch.nn.Module, blocks: list[str], world: int, optimizer_states: int,
            precision: str = "fp32") -> dict:
    """The spread as the plan shows it: the kind, the blocks sharded one by one, the dtypes a sharded model computes
    and reduces in (FSDP2's policy: bf16 parameters gathered for the forward and backward, fp32 gradients reduced into
    fp32 shards; under ddp, None: autocast), and the memory of the model's state (parameters, their gradients, the
    optimizer's `optimizer_states` tensors per parameter) that each worker holds, against the whole model's (a shard is
    the parameter's rows, padded to a multiple of the workers, over them)."""
    whole = per_worker = 0
    for p in model.parameters():
        copies = 1 + (1 + optimizer_states) * p.requires_grad
        rows = max(p.shape[0], 1) if p.dim() else 1
        whole += copies * p.numel() * p.element_size()
        shard = -(-rows // world) * (p.numel() // rows) if kind == "fsdp" else p.numel()
        per_worker += copies * shard * p.element_size()
    mib = 2 ** 20
    param = {"bf16": "bfloat16", "fp32": "float32"}.get(precision, "bfloat16 on a GPU with bf16, else float32")
    policy = {"param_dtype": param, "reduce_dtype": "float32"}  # (a dry run for a GPU this machine lacks: either)
    return {"kind": kind, "blocks": blocks if kind == "fsdp" else [], "policy": policy if kind == "fsdp" else None,
            "model_state_mib": {"whole": round(whole / mib, 2), "per_worker": round(per_worker / mib, 2)}}


def held_mib(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """The MiB of the model's state this rank holds, measured: its parameters, their gradients and the optimizer's
    state (of a sharded model, this rank's shards; AdamW's step counts aside, a number each), as plan.json's estimate
    counts them."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in (*model.parameters(), *grads, *state)]
    return round(sum(t.numel() * t.element_size() for t in local) / 2**20, 2)


def spread_over(kind: str, world: int, device: torch.device, precision: str = "fp32") -> Replicated:
    """The run's spread: --parallel (kind) over `world` workers on `device`'s kind, in `precision` (the run's: under
    fsdp, bf16 is FSDP2's mixed-precision policy)."""
    return Sharded(world, device, precision) if kind == "fsdp" else Replicated()
