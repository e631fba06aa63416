"""The build step (train/run/build.py) in this process, one rank without a process group: the parts a run trains with,
made in the order a bit-identical resume depends on, and a second build resuming where a checkpoint left off."""

import json
import threading

import pytest
import torch

from train.base.errors import ConfigError
from train.cli import parse_config
from train.components.augment import BatchAugment
from train.components.models import build_model
from train.data import build_datasets
from train.files import rundir
from train.run.build import build
from train.run.plan import dry_run, planned_precision
from train.run.runtime import DTYPES, precision_of, resolve_precision

CPU = torch.device("cpu")


def _cfg(run_dir, *flags):
    return parse_config(["--preset", "debug", "--model-ema", "--mixup-alpha", "0.2", "--run-dir", str(run_dir),
                         *flags])


def test_a_fresh_build_makes_every_part_and_writes_the_run_files(tmp_path):
    cfg = _cfg(tmp_path)
    parts = build(cfg, tmp_path, CPU, "fp32")
    parts.metrics.close()

    assert parts.cfg == cfg and parts.resumed is None and (parts.run_dir, parts.device) == (tmp_path, CPU)
    assert parts.model is parts.raw_model  # no process group: nothing wraps it
    assert parts.precision is None and not parts.scaler.is_enabled()
    assert isinstance(parts.augment, BatchAugment) and parts.ema is not None
    assert parts.scheduler is parts.checkpointer.scheduler and parts.checkpointer.model is parts.raw_model
    assert [len(g["params"]) for g in parts.optimizer.param_groups] == \
        [len(g["params"]) for g in parts.plan.param_groups]
    assert parts.task.name == "classification" and parts.task.label_smoothing == cfg.regularisation.label_smoothing
    assert [n.tolist() for n in parts.task.normalisation_on(CPU)] == \
        [torch.tensor(parts.plan.normalize[k]).view(1, 3, 1, 1).tolist() for k in ("mean", "std")]
    # The run's files: the plan as trained, the config, the status of a run that starts at step 0.
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(rundir.to_json(parts.plan.to_dict()))
    assert rundir.read_config(tmp_path) == cfg.to_dict()
    assert rundir.read_status(tmp_path)["state"] == "running" and rundir.read_status(tmp_path)["step"] == 0


def test_the_data_and_the_model_come_right_after_the_seed_and_the_rank_s_stream_last(tmp_path):
    """What bit identity rests on: every rank makes the same data and weights from --seed, and a fresh start then
    trains from its rank's own stream (seed x 7919 + rank), nothing drawn from it before the first step."""
    cfg = _cfg(tmp_path, "--seed", "3")  # not 0: its rank 0 stream would be the seed's own
    torch.rand(7)  # whatever was drawn before
    parts = build(cfg, tmp_path, CPU, "fp32")
    after_build = torch.get_rng_state()
    parts.metrics.close()
    torch.manual_seed(cfg.run.seed)
    _, _, num_classes = build_datasets(cfg)
    model = build_model(cfg.model, num_classes)
    for name, value in model.state_dict().items():
        assert torch.equal(value, parts.raw_model.state_dict()[name]), name
    torch.manual_seed(cfg.run.seed * 7919 + 0)
    assert torch.equal(after_build, torch.get_rng_state())


def test_a_second_build_resumes_where_the_checkpoint_left_off(tmp_path):
    first = build(_cfg(tmp_path), tmp_path, CPU, "fp32")
    with torch.no_grad():
        for p in first.raw_model.parameters():
            p.add_(1.0)  # weights only a resume can give back
    first.checkpointer.save({"step": 12, "epoch": 0, "step_in_epoch": 12, "eval_owed": False}, "a test")
    first.metrics.close()

    parts = build(_cfg(tmp_path, "--max-steps", "60"), tmp_path, CPU, "fp32")  # a longer run
    parts.metrics.close()
    assert parts.resumed.position == {"step": 12, "epoch": 0, "step_in_epoch": 12, "eval_owed": False}
    assert parts.resumed.max_steps == 40
    assert all(torch.equal(a, b) for a, b in zip(parts.raw_model.state_dict().values(),
                                                 first.raw_model.state_dict().values(), strict=True))
    plan = rundir.read_json(tmp_path / "plan.json")
    assert plan["max_steps"] == 60 and plan["resumes"] == [{"step": 12, "changed": {"max_steps": [40, 60]}}]
    assert rundir.read_status(tmp_path)["step"] == 12


def test_the_run_and_its_dry_run_decide_the_precision_in_one_place(tmp_path):
    """--precision auto is decided once (runtime.precision_of): the plan a dry run prints and the one the run trains
    from name the same precision, and the parts autocast to its dtype."""
    cfg = _cfg(tmp_path, "--device", "cpu")
    parts = build(cfg, tmp_path, CPU, resolve_precision(cfg.model, cfg.data, CPU))
    parts.metrics.close()
    assert parts.plan.precision == dry_run(cfg, 1).precision == resolve_precision(cfg.model, cfg.data, CPU) == "fp32"
    assert parts.precision is DTYPES[parts.plan.precision] is None
    for given in ("fp32", "bf16", "fp16"):  # what is given is what a run trains in, on any device
        spec = cfg.model.__class__(**{**vars(cfg.model), "precision": given})
        assert precision_of(spec, "cpu") == precision_of(spec, "cuda") == given
    if not torch.cuda.is_available():  # a plan for GPUs made on a machine without one says what they decide
        assert planned_precision(cfg.model, "cuda").startswith("bf16 on a GPU with bf16")


def test_a_build_that_fails_leaves_no_mlflow_run_running(tmp_path, monkeypatch):
    """A start that fails while it builds (here its metrics file cannot be opened) leaves no MLflow run RUNNING for
    ever: the run starts last, once nothing else can fail, and the worker holds it from there. A real MLflow client
    on a local file store."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the client's local store, without a server
    store, run_dir = (tmp_path / "mlruns").as_uri(), tmp_path / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        build(_cfg(run_dir, "--mlflow-uri", store, "--mlflow-experiment", "builds"), run_dir, CPU, "fp32")
    for thread in threading.enumerate():
        if thread.name == "trainbox-mlflow":  # a Tracker's sender: left behind, it would keep its run RUNNING
            thread.join(5)
            assert not thread.is_alive(), "a Tracker was left sending"
    client = MlflowClient(store)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert [r.info.status for r in client.search_runs(experiments) if r.info.status == "RUNNING"] == []


@pytest.mark.parametrize("recomputed", [False, True])
def test_activation_checkpointing_runs_each_block_again_in_the_backward_to_the_same_gradients(recomputed):
    """--activation-checkpointing: each of the language model's blocks runs its forward twice a step (the second in
    the backward, recomputing what it no longer keeps, last block first), and the gradients are those of the model
    that keeps them."""
    from train.run.build import model_on
    from train.tasks.factory import build_task

    cfg = parse_config(["--task", "lm", *(["--activation-checkpointing"] if recomputed else [])])
    task, calls = build_task(cfg), []
    torch.manual_seed(0)
    model = model_on(cfg.model, task, torch.device("cpu"), 1)
    for name in task.blocks(model):  # a module inside each, as it starts (the recompute stops once it has what the
        # backward needs: before the block's end)
        model.get_submodule(f"{name}.mlp").register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    ids = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(1))
    model(ids).square().mean().backward()
    blocks = [f"blocks.{i}" for i in range(4)]
    assert calls == blocks + (blocks[::-1] if recomputed else [])
    torch.manual_seed(0)
    kept = model_on(parse_config(["--task", "lm"]).model, task, torch.device("cpu"), 1)
    kept(ids).square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), kept.parameters(), strict=True))


@pytest.mark.parametrize("task, model, blocks", [
    ("classification", "cnn", [f"features.{i}" for i in range(3)]),
    ("classification", "resnet18", [f"layer{i}" for i in range(1, 5)]),
    ("classification", "vit_b_16", [f"encoder.layers.encoder_layer_{i}" for i in range(12)]),
    ("classification", "convnext_tiny", [f"features.{i}" for i in range(8)]),
    ("classification", "tests.models:small_cnn_in_double", [f"net.features.{i}" for i in range(3)]),
    ("classification", "googlenet", []),
    ("segmentation", "deeplabv3_resnet50", [f"backbone.layer{i}" for i in range(1, 5)]),
    ("segmentation", "lraspp_mobilenet_v3_large", [f"backbone.{i}" for i in range(17)])])
def test_the_image_tasks_shard_a_network_stage_by_stage(task, model, blocks):
    """--parallel fsdp's blocks of the image tasks (Task.blocks; plan.json's parallel.blocks): a ResNet's stages, a
    ViT's encoder layers, the children of `features` (the built-in CNN's three stages), a segmentation model's
    backbone, in a wrapper too; the root alone for a network of another shape. On the meta device, as the preflight
    checks them."""
    from train.tasks.factory import build_task

    cfg = parse_config(["--task", task, "--model", model, "--parallel", "fsdp", "--spawn", "2"])
    built = build_task(cfg)
    with torch.device("meta"):
        assert built.blocks(built.network(cfg.model)) == blocks


def test_bf16_under_fsdp_is_fsdp2s_policy_bf16_weights_in_the_forward_float32_gradients_and_shards():
    """--precision bf16 --parallel fsdp: FSDP2's MixedPrecisionPolicy on a real one-rank gloo group in this process,
    not autocast. The forward sees bf16 weights and inputs, and gives what the same network cast to bf16 gives, bit
    for bit, as float32 (the loss's dtype); the gradients are that network's, cast to float32, on float32 shards.
    The plan names the policy; the CPU takes it (FSDP2's own casts), where --parallel ddp's bf16 needs a GPU."""
    import copy

    import torch.distributed as dist

    from train.cluster.sharding import Sharded, planned
    from train.run.preflight import check_precision

    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    cast = copy.deepcopy(network).to(torch.bfloat16)
    seen = []
    network[2].register_forward_pre_hook(lambda module, given: seen.append((module.weight.dtype, given[0].dtype)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        spread = Sharded(1, torch.device("cpu"), "bf16")
        sharded = spread.shard(network, ["0"])
        x = torch.randn(5, 8)
        out, want = sharded(x), cast(x.to(torch.bfloat16))
        assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.float32
        assert spread.autocast(torch.bfloat16) is None  # no autocast beside the policy
        assert torch.equal(out, want.float())
        out.square().sum().backward()
        want.float().square().sum().backward()
        for (name, p), q in zip(sharded.named_parameters(), cast.parameters(), strict=True):
            assert p.dtype == p.grad.dtype == torch.float32, name
            assert torch.equal(p.grad.to_local(), q.grad.float()), name
    finally:
        dist.destroy_process_group()
    assert planned("fsdp", network, ["0"], 2, 2, "bf16")["policy"] == {"param_dtype": "bfloat16",
                                                                      "reduce_dtype": "float32"}
    assert planned("ddp", network, [], 2, 2, "bf16")["policy"] is None
    check_precision(parse_config(["--precision", "bf16", "--parallel", "fsdp"]).model, parse_config([]).data, True)
    with pytest.raises(ConfigError, match=r"^--precision bf16 needs a CUDA GPU: use --precision fp32"):
        check_precision(parse_config(["--precision", "bf16"]).model, parse_config([]).data, True)
