"""Run directories and resuming: a run never overwrites another silently, what a killed save left is cleared, and a
resumed run says what changed since its checkpoint, refusing what its optimizer state cannot follow."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch
from conftest import tiny_llama
from test_train_e2e import run_cfg, task

from unison.config import InputError, config_to_dict
from unison.tasks import Task
from unison.train.loop import train


def steps_of(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def edit_trainer_state(checkpoint, edit) -> None:
    path = checkpoint / "trainer_state-rank0.pt"
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


@pytest.fixture(scope="module")
def saved_run(model_dir, tmp_path_factory):
    """A 4-step run (lr 1e-3) that saved checkpoint-2 on the way."""
    out = tmp_path_factory.mktemp("saved") / "run"
    train(run_cfg(model_dir, out, "--optim.lr=1e-3", "--max_steps=4", "--save_every=2"), task())
    return out


def resume_cfg(model_dir, out, checkpoint, *overrides):
    return run_cfg(model_dir, out, "--optim.lr=1e-3", "--max_steps=4", f"--resume={checkpoint}", *overrides)


# --- a used output_dir --------------------------------------------------------------------------------------


@pytest.mark.parametrize("previous", ["config.yaml", "metrics.jsonl", "checkpoint-3/"])
def test_a_used_output_dir_is_refused_before_the_model_loads(previous, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    if previous.endswith("/"):
        (out / previous).mkdir()
    else:
        (out / previous).write_text("")
    with pytest.raises(InputError) as error:  # the model does not exist: the folder is checked first
        train(run_cfg(str(tmp_path / "no-model"), out), task())
    message = str(error.value)
    assert str(out) in message and previous.rstrip("/") in message
    assert all(way in message for way in ("--output_dir", "--resume=", "--overwrite=true")), message


def test_an_empty_missing_or_foreign_output_dir_is_a_fresh_run(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not unison's")
    for name in ("empty", "missing", "foreign"):
        with pytest.raises(FileNotFoundError, match="no-model"):  # past the folder check, on to the model
            train(run_cfg(str(tmp_path / "no-model"), tmp_path / name), task())
        # A run that failed on its inputs wrote nothing: running it again with the fix is not refused.
        assert not (tmp_path / name / "config.yaml").exists()


def test_an_output_dir_that_is_a_file_is_an_input_error(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(InputError, match=re.escape(str(tmp_path / "run")) + ".* is a file"):
        train(run_cfg(str(tmp_path / "no-model"), tmp_path / "run"), task())


def test_a_second_plain_run_is_refused_and_overwrite_removes_only_unisons_outputs(model_dir, tmp_path):
    out = tmp_path / "run"
    train(run_cfg(model_dir, out, "--save_every=1"), task())  # 3 steps: checkpoint-1, checkpoint-2, checkpoint
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(InputError, match="previous run"):
        train(run_cfg(model_dir, out), task())
    assert (out / "metrics.jsonl").read_text() == before and (out / "checkpoint-2").is_dir()

    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "rows.jsonl").write_text("{}\n")
    train(run_cfg(model_dir, out, "--max_steps=2", "--overwrite=true"), task())
    names = set(os.listdir(out))
    events = {n for n in names if n.startswith("events.out.tfevents")}
    assert names - events == {"checkpoint", "config.yaml", "curves.png", "data", "metrics.jsonl", "notes.txt"}
    assert len(events) == 1  # the new run's; the old one's went with its checkpoints
    assert steps_of(out) == [1, 2] and (out / "data" / "rows.jsonl").read_text() == "{}\n"


def test_overwrite_never_deletes_the_checkpoint_it_resumes_from(saved_run, model_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    with pytest.raises(InputError, match="overwrite"):
        train(resume_cfg(str(tmp_path / "no-model"), out, out / "checkpoint-2", "--overwrite=true"), task())
    assert (out / "checkpoint-2" / "trainer_state-rank0.pt").exists()


# --- what a killed save leaves ----------------------------------------------------------------------------


def test_what_a_killed_save_left_is_cleared_at_the_next_start(saved_run, model_dir, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    (out / "checkpoint-2" / "tmp_trainer_state_k1ll3d.pt").write_bytes(b"torn")  # killed in save_trainer_state
    (out / ".checkpoint-4.tmp-ab12cd").mkdir()  # killed in save_pretrained
    (out / ".checkpoint-4.tmp-ab12cd" / "model.safetensors").write_bytes(b"half")
    # Killed between the two renames that replace a checkpoint: the old one is only in the .old folder.
    (out / ".checkpoint.old-ef34").mkdir()
    os.rename(out / "checkpoint", out / ".checkpoint.old-ef34" / "ckpt")
    with caplog.at_level(logging.INFO, logger="unison"):
        train(resume_cfg(model_dir, out, out / "checkpoint-2"), task())
    assert not [n for n in os.listdir(out) if n.startswith(".checkpoint")]
    assert sorted(os.listdir(out / "checkpoint-2")) == sorted(os.listdir(saved_run / "checkpoint-2"))
    assert steps_of(out) == [1, 2, 3, 4, 3, 4]  # the resumed run's steps appended to the first run's
    assert "tmp_trainer_state_k1ll3d.pt" in caplog.text and ".checkpoint-4.tmp-ab12cd" in caplog.text
    assert "restored" in caplog.text and ".checkpoint.old-ef34" in caplog.text


def test_a_checkpoint_found_only_aside_is_restored_not_deleted(saved_run, tmp_path):
    from unison.train.run_dir import clear_leftovers

    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    os.mkdir(out / ".checkpoint-2.old-xy")
    os.rename(out / "checkpoint-2", out / ".checkpoint-2.old-xy" / "ckpt")
    os.mkdir(out / ".checkpoint.old-zz")  # beside a checkpoint that is there: the old copy is garbage
    shutil.copytree(out / "checkpoint", out / ".checkpoint.old-zz" / "ckpt")
    clear_leftovers(str(out))
    assert sorted(os.listdir(out / "checkpoint-2")) == sorted(os.listdir(saved_run / "checkpoint-2"))
    assert not [n for n in os.listdir(out) if n.startswith(".checkpoint")]


# --- resuming with other settings or data -----------------------------------------------------------------


def test_resume_names_what_changed_and_continues(saved_run, model_dir, tmp_path, caplog):
    out = tmp_path / "resumed"
    with caplog.at_level(logging.WARNING, logger="unison"):
        train(resume_cfg(model_dir, out, saved_run / "checkpoint-2", "--optim.lr=5e-4", "--max_steps=5",
                         "--rollout.group_size=2"), task())
    assert steps_of(out) == [3, 4, 5]
    [warning] = [r.getMessage() for r in caplog.records if "rollout.group_size" in r.getMessage()]
    for change in ("optim.lr: 0.001 -> 0.0005", "max_steps: 4 -> 5", "rollout.group_size: 4 -> 2"):
        assert change in warning
    assert "output_dir" not in warning and "resume:" not in warning  # these differ on every resume


@pytest.mark.parametrize("rows", ["fewer", "other prompts"])
def test_resume_on_another_data_set_starts_a_fresh_pass(rows, saved_run, model_dir, tmp_path, caplog):
    base = task()
    new_rows = base.rows[:10] if rows == "fewer" else [dict(r, prompt=r["prompt"] + " w9") for r in base.rows]
    out = tmp_path / "resumed"
    with caplog.at_level(logging.WARNING, logger="unison"):
        train(resume_cfg(model_dir, out, saved_run / "checkpoint-2"), Task("new", new_rows, base.reward_fns))
    assert steps_of(out) == [3, 4]
    assert "fresh pass" in caplog.text and f"{len(base.rows)} rows" in caplog.text
    assert f"-> {len(new_rows)} rows" in caplog.text


@pytest.mark.parametrize("saved_under, message", [("world_size", "saved by 2 processes"),
                                                   ("dist.tp", "dist.tp: 2 -> 1")])
def test_resume_refuses_another_topology(saved_under, message, saved_run, model_dir, tmp_path):
    """Each rank's trainer state holds its own shard of the optimizer state: another tp or number of replicas
    cannot continue from it."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saved_run / "checkpoint-2", ckpt)

    def edit(state):
        if saved_under == "world_size":
            state["world_size"] = 2
        else:
            state.setdefault("config", config_to_dict(run_cfg(model_dir, tmp_path)))["dist"]["tp"] = 2

    edit_trainer_state(ckpt, edit)
    with pytest.raises(InputError, match=message):
        train(resume_cfg(str(tmp_path / "no-model"), tmp_path / "resumed", ckpt), task())  # before the model


def test_a_checkpoint_without_a_saved_config_still_resumes(saved_run, model_dir, tmp_path, caplog):
    """Checkpoints written before trainer states held their run's configuration."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saved_run / "checkpoint-2", ckpt)
    edit_trainer_state(ckpt, lambda state: [state.pop(k, None) for k in ("config", "world_size", "data")])
    out = tmp_path / "resumed"
    with caplog.at_level(logging.WARNING, logger="unison"):
        train(resume_cfg(model_dir, out, ckpt), task())
    assert steps_of(out) == [3, 4]
    assert "nothing can be checked" in caplog.text


def test_a_resumed_run_anchors_its_servers_at_the_resumed_step(saved_run, model_dir, tmp_path):
    """The servers get the resumed weights as version 2, so the first patch (2 -> 3) applies directly: no second
    full sync on request."""
    from unison.engine import Engine, EngineConfig
    from unison.serve import GenerationServer, make_handler
    from unison.sync import Receiver

    model = tiny_llama(seed=1)
    server = GenerationServer(Engine(model, EngineConfig(num_blocks=256, block_size=8, seed=0)),
                              Receiver(dict(model.named_parameters())))
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server, timeout=60))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    out = tmp_path / "resumed"
    try:
        train(resume_cfg(model_dir, out, saved_run / "checkpoint-2", "--sync.mode=sparse",
                         f"--sync.servers=[http://127.0.0.1:{http.server_address[1]}]"), task())
    finally:
        http.shutdown()
        server.stop()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 4] and all(r["sync/anchors"] == 0 for r in records)
    assert server.receiver.version == 4 and server.receiver.counts["anchors"] == 1
    assert server.receiver.counts["rejected"] == 0


def test_save_final_false_writes_no_final_checkpoint_and_keeps_save_every(model_dir, tmp_path):
    out = tmp_path / "run"
    train(run_cfg(model_dir, out, "--save_every=2", "--save_final=false"), task())  # 3 steps
    assert steps_of(out) == [1, 2, 3] and (out / "checkpoint-2").is_dir() and not (out / "checkpoint").exists()
