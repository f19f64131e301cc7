"""`selfspec train` (the LayerSkip recipe) on a tiny random Llama: the schedules, the hooks that
run exits and layer dropout inside the model's own forward, a short run that lowers the early-exit
loss, and a saved checkpoint that reloads through selfspec.load and decodes losslessly."""

import json
import random

import pytest
import torch

import selfspec
from lossless import assert_greedy_lossless
from selfspec.cli import main
from selfspec.tools.train import Recipe, prepare, save, train
from selfspec.tools.train.data import Batch, read_data
from selfspec.tools.train.exits import Exits, exit_forward
from selfspec.tools.train.recipe import active_exits, dropout_rates, exit_scales, exit_weights
from tiny_models import VOCAB, tiny_model, tiny_tokenizer


def words(rng, n):
    return " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(n))


def test_dropout_rates_rise_with_depth_to_p_max():
    rates = dropout_rates(30, 0.2)
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.2)
    assert (rates.diff() > 0).all()
    assert rates[15] < 0.2 * 15 / 29  # exponential: below the straight line from 0 to p_max
    assert (dropout_rates(30, 0.0) == 0).all()


def test_exit_scales_rise_with_depth_and_weights_sum_to_one():
    scales = exit_scales(6, 1.0)
    assert scales.tolist() == [0, 1, 3, 6, 10, 5 + 10]  # e_scale·Σ_{i<k} i; the last: L-1 + e_scale·Σ_{i<L-1} i
    weights = exit_weights([2, 4, 6], scales)
    assert sum(weights.values()) == pytest.approx(1)
    assert weights[2] < weights[4] < weights[6]
    assert exit_weights([3, 6], exit_scales(6, 0.0)) == {3: 0.0, 6: 1.0}  # e_scale 0: plain fine-tuning


def test_curricula_choose_the_active_exits():
    L, R = 6, 2
    rot = [active_exits(step, 100, L, "rotational", R) for step in range(4)]
    assert rot == [[1, 3, 5, 6], [2, 4, 6], [1, 3, 5, 6], [2, 4, 6]]  # every R-th exit, rotating; L always
    assert all(len(active_exits(s, 100, 30, "rotational", 8)) in (4, 5) for s in range(8))

    gradual = [active_exits(step, 100, L, "gradual", R) for step in range(0, 101, 10)]
    assert gradual[0] == [6]  # at first only the last layer
    assert all(set(a) <= set(b) for a, b in zip(gradual, gradual[1:]))  # exits are only ever added...
    assert [g[0] for g in gradual[:6]] == [6, 5, 4, 3, 2, 1]  # ...from the top down...
    assert gradual[5] == [1, 2, 3, 4, 5, 6]  # ...all on by half of the run
    assert active_exits(0, 100, L, "none", R) == [1, 2, 3, 4, 5, 6]


def test_exits_read_the_models_own_forward_and_drop_layers_per_row():
    model = selfspec.SelfSpecModel(tiny_model("llama"), name="tiny")
    adapter, ids = model.adapter, torch.randint(0, VOCAB, (2, 12))
    batch = Batch(ids, None, ids)
    with Exits(adapter.layers) as exits:
        logits = exit_forward(adapter, exits, batch, [3, 6])
        torch.testing.assert_close(logits[6], model.hf_model(ids).logits)  # exit L is the full model
        draw = torch.zeros(6, 2, dtype=torch.bool)
        draw[3, 0] = True  # layer 3 skipped for row 0 only
        exits.dropout(draw)
        exit_forward(adapter, exits, batch, [3, 4])
        skipped = exits.states
        torch.testing.assert_close(skipped[4][0], skipped[3][0])
        assert not torch.allclose(skipped[4][1], skipped[3][1])
    assert all(not layer._forward_hooks for layer in adapter.layers)  # nothing left on the model


def test_read_data_texts_and_prompts(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "w5 w6"}\n\n{"turns": ["w7 w8"]}\n{"prompt": "w9"}\n')
    assert read_data(path) == (["w5 w6"], ["w7 w8", "w9"])
    (tmp_path / "t.txt").write_text("w1 w2 w3")
    assert read_data(tmp_path / "t.txt") == (["w1 w2 w3"], [])
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_data(tmp_path / "bad.jsonl")


def test_training_lowers_the_early_exit_loss_and_saves_a_lossless_checkpoint(tmp_path):
    rng = random.Random(0)
    data_file = tmp_path / "data.jsonl"
    rows = [{"prompt": words(rng, 8)} for _ in range(20)] + [{"text": words(rng, 200)}]
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = selfspec.SelfSpecModel(tiny_model("llama"), tiny_tokenizer(), name="tiny")
    data = prepare(model, data_file, max_new_tokens=24, seq_len=32, holdout=0.2, progress=False)  # 20 + 7 documents
    assert len(data.prompts) == 5 and all(1 <= len(p) <= 16 for p in data.prompts)

    recipe = Recipe(steps=40, lr=1e-3, batch_size=8, seq_len=32, p_max=0.2, rotation=2)
    lines = []
    result = train(model, data, recipe, [2, 3], alpha_tokens=16, progress=False, log=lines.append)
    assert [h["step"] for h in result.history] == [0, 8, 16, 24, 32, 40] and len(lines) == 6
    for k in (2, 3):
        assert result.after.loss[k] < result.before.loss[k] - 0.1, result.table()
    assert set(result.after.alpha) == {2, 3} and "α at k=2" in result.table()

    out = save(model, tmp_path / "ckpt", result)
    assert json.loads((out / "selfspec_train.json").read_text())["recipe"]["steps"] == 40
    loaded = selfspec.load(str(out), dtype="float32", progress=False)
    for (name, p), q in zip(model.hf_model.state_dict().items(), loaded.hf_model.state_dict().values()):
        assert torch.equal(p, q), name
    assert loaded.tokenizer("w5 w17")["input_ids"] == [5, 17]
    assert_greedy_lossless(loaded, method="early-exit", exit_layer=3, draft_len=3)


def test_cli_checks_its_arguments_before_loading(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["train", "--out", str(tmp_path / "full")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "new"), "--p-max", "1.5"]) == 2
    assert "p_max" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--data", "--out", "--steps", "--lr", "--batch-size", "--seq-len", "--p-max", "--curriculum",
                 "--rotation", "--exit-layers", "--seed"):
        assert flag in help_text


def test_cli_train_and_calibrate_run_to_the_end_on_a_tiny_checkpoint(tmp_path, capsys):
    """Both commands print their report and exit 0 (a report line once read fields their results
    do not have)."""
    ckpt = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    rng = random.Random(0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": words(rng, 80)}) + "\n" for _ in range(6)))
    assert main(["train", "--model", str(ckpt), "--out", str(tmp_path / "out"), "--data", str(data), "--steps", "2",
                 "--batch-size", "2", "--seq-len", "16", "-k", "2", "-n", "4"]) == 0
    assert "trained" in capsys.readouterr().out
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": words(rng, 6)}) + "\n" for _ in range(4)))
    assert main(["calibrate", "--model", str(ckpt), "--prompts", str(prompts), "--num-prompts", "4", "-n", "6",
                 "-k", "2", "--steps", "2", "--batch-size", "8", "--output", str(tmp_path / "cal"),
                 "--holdout", "0.25"]) == 0
    assert "adapter k=2" in capsys.readouterr().out
