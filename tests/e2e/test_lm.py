"""--task lm end to end: gpt-tiny on the copy documents under --spawn, its evaluation at another world size with the
report's continuations, its export (token ids in, logits out, the batch and the sequence's length dynamic) as a
torch-only program and an ONNX model; a text folder through a tokenizer.json, stopped and resumed, another tokenizer
refused; and accumulation, workers and a resume on half of them training on the large batch's mean of labelled tokens
(a float64 network)."""

import hashlib
import json
import random
import sys

import numpy as np
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import PY, REPO, byte_level_tokenizer, load_model, make, metrics, python_cmd, run, status
from train.components.gpt import SIZES, Gpt
from train.files import shards

LM = ["--task", "lm", "--train-samples", 512, "--val-samples", 60, "--max-steps", 30, "--eval-every", 15,
      "--log-every", 5, "--batch-size", 16]
SHAPES = [(9, 20), (2, 20), (9, 7), (2, 7)]  # two batch sizes, two lengths

TORCH_ONLY = """
import sys
sys.modules["torchvision"] = None
sys.modules["train"] = None
import torch
program = torch.export.load(sys.argv[1]).module()
ids = torch.load(sys.argv[2])
torch.save([program(ids[:n, :t]) for n, t in %r], sys.argv[3])
""" % (SHAPES,)

ONNX_RUNTIME_ONLY = """
import json, sys
for name in ("torch", "train", "torchvision"):
    sys.modules[name] = None
import numpy as np, onnxruntime
session = onnxruntime.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
ids = np.load(sys.argv[2])
(given,), (logits,) = session.get_inputs(), session.get_outputs()
np.savez(sys.argv[3], *[session.run(None, {given.name: ids[:n, :t]})[0] for n, t in %r])
print(json.dumps({"input": [given.name, given.shape], "output": [logits.name, logits.shape]}))
""" % (SHAPES,)


def test_a_language_model_trains_evaluates_with_continuations_and_exports_with_both_dimensions_dynamic(tmp_path,
                                                                                                        tool_setup):
    run_dir = tmp_path / "run"
    trained = run(python_cmd(*LM, "--spawn", 2, "--run-dir", run_dir))
    assert " tokens/s " in trained.stderr and all(m["tokens_per_s"] == m["samples_per_s"] * 64
                                                  for m in metrics(run_dir, "train"))
    evals = metrics(run_dir, "eval")
    assert [e["samples"] for e in evals] == [60, 60] and evals[-1]["loss"] < evals[0]["loss"] < 5.0  # ln 257: 5.55
    assert evals[-1]["excess"] == evals[-1]["loss"] - evals[-1]["floor"] > 0
    described = json.loads((run_dir / "task.json").read_text())
    assert described["context"] == 64 and described["floor"] == evals[-1]["floor"] and described["vocab_size"] == 257
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["task"]["context"] == 64 and plan["source"]["kind"] == "copy" and plan["val_samples"] == 60
    # make evaluate on 3 workers (60 windows: 20 each): the same tokens, the loss to float32's rounding; its report
    scored = run([PY, "-m", "train.evaluate", str(run_dir), "--spawn", "3"])
    report = json.loads((run_dir / "eval-model.json").read_text())
    assert (report["tokens"], report["samples"]) == (evals[-1]["tokens"], 60)
    assert abs(report["loss"] - evals[-1]["loss"]) <= 1e-6 * evals[-1]["loss"]
    assert len(report["continuations"]) == 3 and all(len(c["prompt"]) >= 1 for c in report["continuations"])
    assert "greedy" in scored.stdout and "over the floor" in scored.stdout
    # make export: token ids N x T in, logits out, both dynamic, in a process with torch alone and in ONNX Runtime
    make("export", f"RUN={run_dir}")
    shipped = json.loads((run_dir / "model.pt2.json").read_text())
    assert shipped["task"] == "lm" and shipped["input_shape"] == ["N", "T"] and shipped["context"] == 64
    ids = torch.randint(0, 257, (9, 20))
    torch.save(ids, tmp_path / "ids.pt")
    run([sys.executable, "-I", "-c", TORCH_ONLY, str(run_dir / "model.pt2"), str(tmp_path / "ids.pt"),
         str(tmp_path / "out.pt")])
    model = Gpt(SIZES["gpt-tiny"], 257)
    model.load_state_dict(load_model(run_dir))
    with torch.no_grad():
        expected = [model.eval()(ids[:n, :t]) for n, t in SHAPES]
    for got, want in zip(torch.load(tmp_path / "out.pt"), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32
    tool_setup("onnx-setup")
    make("export", f"RUN={run_dir}", "FORMAT=onnx")
    np.save(tmp_path / "ids.npy", ids.numpy())
    served = run([str(REPO / ".venv-onnx" / "bin" / "python"), "-I", "-c", ONNX_RUNTIME_ONLY,
                  str(run_dir / "model.onnx"), str(tmp_path / "ids.npy"), str(tmp_path / "out.npz")])
    assert json.loads(served.stdout) == {"input": ["ids", ["batch", "sequence"]],
                                         "output": ["logits", ["batch", "sequence", 257]]}
    with np.load(tmp_path / "out.npz") as saved:
        for i, want in enumerate(expected):
            torch.testing.assert_close(torch.from_numpy(saved[f"arr_{i}"]), want, rtol=1e-4, atol=1e-4)


def test_accumulation_workers_and_a_resume_on_half_of_them_train_on_the_large_batchs_mean_of_labelled_tokens(tmp_path):
    """Each copy window pads its end by its own amount: --grad-accum 3 at batch 8, batch 24, and 4 workers at batch 2
    with --grad-accum 3 stopped after step 2, resumed replicated (DDP) on 2 (accumulation 6 keeps the global batch) and
    sharded (--parallel fsdp: its checkpoint gathered whole, resharded on 3, whose shards of 257 rows are unequal, at
    accumulation 4), train on the same mean (the labelled tokens of the whole step) at the same learning rates, in
    float64 to rounding (1e-9), where a mean per micro-batch is off by far more; the sharded checkpoint holds the large
    batch's optimizer state in its format. The 4 sharded workers' --checkpoint-format sharded folder (each its own
    shards) resumes on 3 to that run bit for bit: every weight and every optimizer tensor. Every layout starts from the
    same --weights (loaded whole, then sharded) with the position table and block 0's attention frozen (the block's
    layer norms trained beside them): those end as they started, bit for bit."""
    from tests.models import gpt_tiny_in_double

    torch.manual_seed(1)
    network = gpt_tiny_in_double(257)  # the copy documents' 256 bytes and the end of a document
    start = network.state_dict()
    torch.save(start, tmp_path / "start.pt")
    frozen = [k for k in start if k.startswith(("positions.", "blocks.0.attn."))]
    flags = ["--task", "lm", "--model", "tests.models:gpt_tiny_in_double", "--train-samples", 256, "--val-samples",
             20, "--max-steps", 4, "--eval-every", 4, "--log-every", 1, "--num-workers", 0,
             "--weights", tmp_path / "start.pt", "--freeze", "positions,blocks.0.attn"]
    stopped = ["--batch-size", 2, "--grad-accum", 3, "--spawn", 4, "--stop-at", 2]
    layouts = {"accumulated": ["--batch-size", 8, "--grad-accum", 3], "large": ["--batch-size", 24],
               "halved": stopped, "sharded": [*stopped, "--parallel", "fsdp"],
               "dcp": [*stopped, "--parallel", "fsdp", "--checkpoint-format", "sharded"]}
    for name, layout in layouts.items():
        run(python_cmd(*flags, *layout, "--run-dir", tmp_path / name), expect=75 if "--stop-at" in layout else 0)
    for name, spread, workers in (("halved", [], 2), ("sharded", ["--parallel", "fsdp"], 3),
                                  ("dcp", ["--parallel", "fsdp"], 3)):
        resumed = run(python_cmd(*flags, "--batch-size", 2, "--grad-accum", 3, "--spawn", workers, *spread,
                                 "--run-dir", tmp_path / name))  # the same command on fewer workers
        assert f"on {workers} workers: accumulation {24 // 2 // workers} keeps the global batch of 24" in \
            resumed.stderr, resumed.stderr[-2000:]
    logged = {name: metrics(tmp_path / name, "train") for name in layouts}
    weights = {name: load_model(tmp_path / name) for name in layouts}
    # the 4 workers' shards, each written by its worker (step_2.dcp), read by 3: the gathered checkpoint's run bit for
    # bit (its step 4 saved whole: a resume may change the format)
    assert [p.name for p in (tmp_path / "dcp" / "checkpoints").iterdir() if p.is_dir()] == ["step_00000002.dcp"]
    assert [(m["loss"], m["lr"]) for m in logged["dcp"]] == [(m["loss"], m["lr"]) for m in logged["sharded"]]
    assert all(torch.equal(weights["dcp"][k], weights["sharded"][k]) for k in weights["sharded"])
    for name in ("accumulated", "halved", "sharded"):
        assert [m["step"] for m in logged[name]] == [1, 2, 3, 4]
        assert [m["lr"] for m in logged[name]] == [m["lr"] for m in logged["large"]]
        assert all(abs(a["loss"] - b["loss"]) < 1e-9 for a, b in zip(logged[name], logged["large"], strict=True))
        assert all((weights[name][k] - weights["large"][k]).abs().max() < 1e-9 for k in weights["large"]), name
    for name in layouts:
        assert [k for k in start if torch.equal(weights[name][k], start[k])] == frozen, name
    large, sharded, dcp = (torch.load(tmp_path / name / "checkpoints" / "step_00000004.pt")["optimizer"]
                           for name in ("large", "sharded", "dcp"))
    assert all(torch.equal(dcp["state"][i][k], sharded["state"][i][k]) for i in sharded["state"]
               for k in sharded["state"][i]) and dcp["param_groups"] == sharded["param_groups"]
    assert sharded["param_groups"] == large["param_groups"] and sharded["state"].keys() == large["state"].keys()
    assert all((sharded["state"][i][k] - large["state"][i][k]).abs().max() < 1e-9
               for i in large["state"] for k in large["state"][i])
    # the 4 workers' shards of step 2 read whole in one process by torch's own converter (docs/training.md): the
    # gathered checkpoint of that step, every weight and every AdamW tensor bit for bit
    dcp_to_torch_save(tmp_path / "dcp" / "checkpoints" / "step_00000002.dcp", tmp_path / "whole.pt")
    whole, gathered = (torch.load(path) for path in (tmp_path / "whole.pt",
                                                     tmp_path / "sharded" / "checkpoints" / "step_00000002.pt"))
    assert whole["model"].keys() == gathered["model"].keys()
    assert all(torch.equal(whole["model"][k], gathered["model"][k]) for k in gathered["model"])
    names = [name for group in whole["optimizer"]["param_groups"] for name in group["params"]]
    moments = {names[i]: state for i, state in gathered["optimizer"]["state"].items()}
    assert moments.keys() == whole["optimizer"]["state"].keys() and all(
        torch.equal(whole["optimizer"]["state"][name][k], moments[name][k]) for name in moments for k in moments[name])
    planned = json.loads((tmp_path / "sharded" / "plan.json").read_text())["parallel"]
    assert planned["blocks"] == [f"blocks.{i}" for i in range(SIZES["gpt-tiny"].layers)]
    moment = sum(s["exp_avg"].numel() * s["exp_avg"].element_size() for s in large["state"].values())
    weighed = sum(p.numel() * p.element_size() for p in network.parameters())
    assert planned["model_state_mib"]["whole"] == round((weighed + 3 * moment) / 2**20, 2)  # the trained ones' too:
    # their gradients and two moments
    # what each attempt's fullest worker held at its first step: all of it under DDP, on 4 and on 2; sharded on 3 (the
    # plan's own start) its estimate
    held = {name: [m["model_state_mib"] for m in metrics(tmp_path / name, "first_step")]
            for name in ("halved", "sharded")}
    assert held["halved"] == [planned["model_state_mib"]["whole"]] * 2
    assert held["sharded"][0] < held["sharded"][1] == planned["model_state_mib"]["per_worker"] < held["halved"][0]


def test_a_sharded_run_evaluates_unequal_shares_in_lockstep_and_resumes_bit_for_bit(tmp_path):
    """--parallel fsdp on 3 workers, gpt-tiny in float32 (FSDP reduces its gradients with gloo's SUM alone): 25
    validation windows in batches of 8 are 2, 1 and 1 batches a rank, and every forward gathers from every rank, so
    the ranks short of batches pass an example that counts nothing: no hang, each window counted once, the loss that
    one process gives the last checkpoint (to float32's rounding). Stopped at step 2 (its evaluation owed) and resumed
    on 3 from its workers' own shards (--checkpoint-format sharded), the run is the uninterrupted one bit for bit; and
    so is a run that recomputes each block's activations in the backward (--activation-checkpointing). The shards read
    whole in one process are the gathered checkpoint of the same step, bit for bit; make evaluate and make export read
    the folder."""
    flags = ["--task", "lm", "--train-samples", 256, "--val-samples", 25, "--max-steps", 4, "--eval-every", 2,
             "--log-every", 1, "--num-workers", 0, "--batch-size", 4, "--spawn", 3, "--parallel", "fsdp",
             "--save-every", 2]
    sharded = ["--checkpoint-format", "sharded"]
    run(python_cmd(*flags, "--run-dir", tmp_path / "whole"))
    run(python_cmd(*flags, *sharded, "--stop-at", 2, "--run-dir", tmp_path / "stopped"), expect=75)
    run(python_cmd(*flags, *sharded, "--run-dir", tmp_path / "stopped"))
    run(python_cmd(*flags, "--activation-checkpointing", "--run-dir", tmp_path / "recomputed"))
    kept = ("step", "loss", "lr", "tokens", "samples", "perplexity")
    for kind in ("train", "eval"):
        whole, stopped = ([{k: m[k] for k in kept if k in m} for m in metrics(tmp_path / name, kind)]
                          for name in ("whole", "stopped"))
        assert whole == stopped and len(whole) == (4 if kind == "train" else 2), kind
    assert [e["samples"] for e in metrics(tmp_path / "whole", "eval")] == [25, 25]
    planned = json.loads((tmp_path / "whole" / "plan.json").read_text())["parallel"]["model_state_mib"]
    held = [m["model_state_mib"] for name in ("whole", "stopped") for m in metrics(tmp_path / name, "first_step")]
    assert held == [planned["per_worker"]] * 3  # measured on each attempt's fullest worker: the plan's estimate
    weights = {name: load_model(tmp_path / name) for name in ("whole", "stopped", "recomputed")}
    for name in ("stopped", "recomputed"):
        assert all(torch.equal(weights["whole"][k], weights[name][k]) for k in weights["whole"]), name
    folders = {step: tmp_path / "stopped" / "checkpoints" / f"step_0000000{step}.dcp" for step in (2, 4)}
    gathered = torch.load(tmp_path / "whole" / "checkpoints" / "step_00000002.pt")["model"]
    read = shards.read_model(folders[2])
    assert read.keys() == gathered.keys() and all(torch.equal(read[k], gathered[k]) for k in gathered)
    run([PY, "-m", "train.evaluate", str(tmp_path / "stopped"), "--checkpoint", str(folders[4])])
    alone = json.loads((tmp_path / "stopped" / "eval-step_00000004.json").read_text())
    last = metrics(tmp_path / "whole", "eval")[-1]
    assert (alone["samples"], alone["tokens"]) == (25, last["tokens"])
    assert abs(alone["loss"] - last["loss"]) <= 1e-6 * last["loss"]
    run([PY, "-m", "train.export", str(tmp_path / "stopped"), "--checkpoint", str(folders[4]), "--out",
         str(tmp_path / "shipped.pt2")])
    shipped = torch.export.load(tmp_path / "shipped.pt2").state_dict
    assert shipped.keys() == weights["whole"].keys() and all(torch.equal(shipped[k], weights["whole"][k])
                                                             for k in shipped)


def test_a_text_folder_through_a_tokenizer_json_trains_resumes_evaluates_and_refuses_another_tokenizer(tmp_path):
    """docs/tasks.md's --dataset text with --tokenizer: a byte-level BPE tokenizer.json trained here on the folder's own
    text; its sha256 in task.json; stopped, a resume with a changed file refused in one line and nothing written, with
    the file back it finishes; make evaluate continues the prompts in the tokenizer's words."""
    rng, words = random.Random(0), ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "to", "café", "über"]
    data = tmp_path / "corpus"
    texts = []
    for split, files in (("train", 6), ("val", 2)):
        (data / split).mkdir(parents=True)
        for i in range(files):
            texts.append(" ".join(rng.choice(words) for _ in range(150)) + "\n")
            (data / split / f"{i}.txt").write_text(texts[-1], encoding="utf-8")
    tokenizer = byte_level_tokenizer(texts, tmp_path / "tokenizer.json")
    run_dir = tmp_path / "run"
    flags = ["--task", "lm", "--dataset", "text", "--data-dir", data, "--tokenizer", tokenizer, "--max-steps", 8,
             "--batch-size", 8, "--eval-every", 4, "--log-every", 2, "--run-dir", run_dir]
    run(python_cmd(*flags, "--stop-at", 4), expect=75)
    described = json.loads((run_dir / "task.json").read_text())
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    assert (described["vocab_size"], described["end_token"]) == (vocab + 1, vocab)
    assert described["tokenizer_sha256"] == hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    planned = json.loads((run_dir / "plan.json").read_text())["task"]
    assert (planned["tokenizer_sha256"], planned["vocab_size"]) == (described["tokenizer_sha256"], vocab + 1)
    original, written = tokenizer.read_bytes(), sorted(p.name for p in run_dir.rglob("*"))
    before = (run_dir / "metrics.jsonl").read_bytes()
    changed = Tokenizer.from_file(str(tokenizer))
    changed.add_tokens(["<extra>"])
    changed.save(str(tokenizer))
    refused = run(python_cmd(*flags), expect=2)
    assert refused.stderr.strip().splitlines() == [
        f"error: --tokenizer {tokenizer} is not the file {run_dir} was trained with (sha256 "
        f"{hashlib.sha256(tokenizer.read_bytes()).hexdigest()[:12]}..., the run's "
        f"{described['tokenizer_sha256'][:12]}...): give that file back, or start a new --run-dir"]
    assert status(run_dir)["state"] == "stopped" and (run_dir / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in run_dir.rglob("*")) == written
    tokenizer.write_bytes(original)
    resumed = run(python_cmd(*flags))
    assert "resumed from" in resumed.stderr and [m["step"] for m in metrics(run_dir, "eval")] == [4, 8]
    run([PY, "-m", "train.evaluate", str(run_dir)])
    report = json.loads((run_dir / "eval-model.json").read_text())
    assert "bits_per_byte" not in report and report["loss"] == metrics(run_dir, "eval")[-1]["loss"]
    prompts = [c["prompt"] for c in report["continuations"]]
    assert prompts and all(set(p.split()) <= set(words) for p in prompts), prompts  # the tokenizer's words, decoded
