"""Hostile and broken input to the weight sync: a patch refused before any write changes nothing but the counts; an
apply is all or nothing; versions never go backwards but for the trainer's restart anchor; a bad directory entry
never stops a subscriber; the trainer names a wrong token or an unreachable server."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import save as st_save

from unison.config import InputError
from unison.sync import Framed, Receiver, anchor_patch, decode, encode, frame, sparse_patch
from unison.sync.codec import _contents
from unison.sync.publisher import SyncConfig, WeightPublisher
from unison.sync.transports import DirectorySender, DirectorySource, FsspecConfig, directory


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    return {"a": torch.randn(6, 4, generator=g).to(bf16), "b": torch.randn(10, generator=g).to(bf16),
            "c": torch.randn(3, 3, generator=g)}


def clone(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in params.items()}


def bits_equal(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(x[n].view(-1).view(torch.uint8), y[n].view(-1).view(torch.uint8)) for n in x)


def step(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Change about a third of each tensor's elements in place (the first always); returns the changed masks."""
    g = torch.Generator().manual_seed(seed)
    masks = {}
    for name, t in params.items():
        mask = torch.rand(t.shape, generator=g) < 0.3
        mask.view(-1)[0] = True
        t[mask] += 1
        masks[name] = mask
    return masks


def synced_at_3():
    """The trainer's weights at version 3, a receiver holding the same, and the trainer's patch 3 -> 4."""
    trainer = weights()
    receiver = Receiver(clone(trainer), version=3)
    masks = step(trainer, 4)
    return trainer, receiver, sparse_patch(trainer, masks, 3, 4)


def resaved(patch, edit) -> bytes:
    """``patch`` encoded after ``edit(tensors, meta)`` changed its safetensors contents."""
    tensors, meta = _contents(patch)
    edit(tensors, meta)
    return st_save(tensors, metadata=meta)


def with_value(patch, name, fn):
    patch.values[name] = fn(patch.values[name].clone())
    return encode(patch)


def set_meta(key, value):
    return lambda tensors, meta: meta.__setitem__(key, value)


def framed_with_meta(patch, key, value) -> Framed:
    f = frame(patch)
    header = json.loads(f.header)
    header["meta"][key] = value
    return Framed(json.dumps(header).encode(), f.parts)


def nan_at_0(t):
    t.view(-1)[0] = float("nan")
    return t


REFUSED = {  # each builds, from the trainer's weights at 4 and its patch 3 -> 4, what a receiver at 3 must refuse
    "one garbage byte": lambda w, p: b"\x07",
    "truncated": lambda w, p: encode(p)[:-7],
    "index out of bounds": lambda w, p: resaved(p, lambda t, m: t["b.idx"].__setitem__(-1, 10)),
    "stale (base behind)": lambda w, p: encode(sparse_patch(w, {n: torch.ones_like(t, dtype=torch.bool)
                                                                for n, t in w.items()}, 2, 3)),
    "not moving forward": lambda w, p: encode(sparse_patch(w, {"a": torch.ones(6, 4, dtype=torch.bool)}, 3, 3)),
    "anchor going backwards": lambda w, p: encode(anchor_patch(w, 2)),
    "NaN values": lambda w, p: with_value(p, "c", nan_at_0),
    "NaN anchor with matching checksums": lambda w, p: encode(anchor_patch({**w, "c": nan_at_0(w["c"].clone())}, 4)),
    "2-D values": lambda w, p: with_value(p, "c", lambda t: t.reshape(-1, 1)),  # "c" comes last: a, b were written
    "checksums a JSON list": lambda w, p: resaved(p, set_meta("checksums", json.dumps(list(p.checksums.values())))),
    "checksums a list, framed": lambda w, p: framed_with_meta(p, "checksums", list(p.checksums.values())),
    "no checksum for a touched tensor": lambda w, p: resaved(
        p, set_meta("checksums", json.dumps({n: c for n, c in p.checksums.items() if n != "c"}))),
    "version not an integer": lambda w, p: resaved(p, set_meta("version", "4.0")),
    "anchor flag not 0 or 1": lambda w, p: resaved(p, set_meta("anchor", "true")),
    "index encoding a list": lambda w, p: resaved(p, set_meta("index_encoding", json.dumps(["gap16"]))),
    "index encoding not strings": lambda w, p: resaved(p, set_meta("index_encoding", json.dumps({"a": 16}))),
    "an extra tensor": lambda w, p: resaved(p, lambda t, m: t.__setitem__("zzz", torch.zeros(2))),
    "another format": lambda w, p: resaved(p, set_meta("format", "unison-patch-9")),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_a_patch_refused_before_any_write_changes_nothing_but_the_count(kind):
    trainer, receiver, patch = synced_at_3()
    before = clone(receiver.params)
    assert receiver.receive(REFUSED[kind](clone(trainer), decode(encode(patch)))) is False
    assert receiver.counts["rejected"] == 1 and receiver.last_error
    assert not receiver.needs_anchor and receiver.weights_valid and receiver.version == 3
    assert bits_equal(receiver.params, before)
    assert receiver.receive(encode(patch))  # the trainer's own patch still applies
    assert bits_equal(receiver.params, trainer)


def test_a_checksum_mismatch_is_undone_and_asks_for_an_anchor():
    trainer, receiver, patch = synced_at_3()
    receiver.params["b"].view(-1)[-1] += 3  # the receiver had diverged where the patch does not write
    before = clone(receiver.params)
    assert not receiver.receive(encode(patch))
    assert "checksum mismatch" in receiver.last_error
    assert receiver.needs_anchor and not receiver.weights_valid and receiver.version == 3
    assert bits_equal(receiver.params, before)  # every patched element restored
    assert receiver.receive(encode(anchor_patch(trainer, 4)))
    assert receiver.weights_valid and not receiver.needs_anchor and bits_equal(receiver.params, trainer)


def test_an_anchor_is_verified_before_it_replaces_anything():
    trainer = weights()
    receiver = Receiver(weights(seed=1))
    before = clone(receiver.params)
    anchor = anchor_patch(trainer, 0)
    anchor.values["c"] = anchor.values["c"] + 1  # corrupted on the way; the checksums are the trainer's
    assert not receiver.receive(encode(anchor)) and "its own checksums" in receiver.last_error
    assert bits_equal(receiver.params, before)
    assert receiver.needs_anchor and not receiver.weights_valid  # as they were: still waiting for a good anchor


def test_weights_valid_and_needs_anchor_follow_what_the_receiver_holds():
    trainer = weights()
    fresh = Receiver(weights(seed=1))
    assert (fresh.needs_anchor, fresh.weights_valid) == (True, False)
    assert not fresh.receive(encode(sparse_patch(trainer, step(clone(trainer), 1), 0, 1)))  # no anchor yet
    assert (fresh.needs_anchor, fresh.weights_valid) == (True, False)
    assert (Receiver(clone(trainer), version=0).needs_anchor, Receiver(clone(trainer), version=0).weights_valid) == \
        (False, True)
    assert fresh.receive(encode(anchor_patch(trainer, 0)))
    assert (fresh.needs_anchor, fresh.weights_valid) == (False, True)
    step(trainer, 1)
    masks = step(trainer, 2)
    assert not fresh.receive(encode(sparse_patch(trainer, masks, 1, 2)))  # patch 0 -> 1 went missing
    assert "went missing" in fresh.last_error
    assert (fresh.needs_anchor, fresh.weights_valid, fresh.version) == (True, True, 0)  # behind, but the trainer's


def test_versions_never_go_backwards_but_for_a_restart_anchor():
    trainer = weights()
    receiver = Receiver(weights(seed=1))
    assert receiver.receive(encode(anchor_patch(trainer, 5)))
    assert not receiver.receive(encode(anchor_patch(trainer, 3))) and "back from version 5" in receiver.last_error
    assert receiver.version == 5 and not receiver.needs_anchor
    restarted = weights(seed=2)  # a trainer that started again, from other weights
    assert receiver.receive(encode(anchor_patch(restarted, 3, restart=True)))
    assert receiver.version == 3 and bits_equal(receiver.params, restarted)
    again = weights(seed=3)  # a restart anchor at the version held is applied too: the weights may differ
    assert receiver.receive(encode(anchor_patch(again, 3, restart=True))) and bits_equal(receiver.params, again)
    assert receiver.counts["anchors"] == 3 and receiver.counts["anchors_not_needed"] == 0


def test_the_restart_flag_travels_in_both_framings_and_an_older_format_still_reads():
    params = weights()
    for restart in (False, True):
        patch = anchor_patch(params, 2, restart=restart)
        assert decode(encode(patch)).restart == decode(frame(patch)).restart == restart
    old = resaved(anchor_patch(params, 2), lambda t, m: (m.pop("restart"), m.__setitem__("format", "unison-patch-2")))
    assert decode(old).restart is False and decode(old).version == 2


def test_random_corruption_never_escapes_and_never_half_applies():
    trainer, receiver, patch = synced_at_3()
    blob = encode(patch)
    g = torch.Generator().manual_seed(0)
    applied = 0
    for _ in range(300):
        bad = bytearray(blob)
        for pos in torch.randint(0, len(bad), (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist():
            bad[pos] = int(torch.randint(0, 256, (1,), generator=g))
        copy = Receiver(clone(receiver.params), version=3)
        if copy.receive(bytes(bad)):
            applied += 1  # the flipped bits were somewhere harmless (the JSON header's padding, say)
            assert bits_equal(copy.params, trainer)
        else:
            assert bits_equal(copy.params, receiver.params)
    assert applied < 300


# The directory transport


def published(tmp_path, versions=(0,)):
    trainer = weights()
    url = str(tmp_path / "sync")
    pub = DirectorySender(url)
    pub.publish(encode(anchor_patch(trainer, 0)), 0, anchor=True)
    for v in versions[1:]:
        pub.publish(encode(sparse_patch(trainer, step(trainer, v), v - 1, v)), v, anchor=False)
    return trainer, url, pub


def test_a_folder_named_like_a_patch_is_skipped_with_one_warning(tmp_path, caplog):
    trainer, url, pub = published(tmp_path, versions=(0, 1))
    (tmp_path / "sync" / "0000000002.patch").mkdir()
    (tmp_path / "sync" / "requests" / "a-folder").mkdir()
    sub = DirectorySource(url, Receiver(weights(seed=1)))
    with caplog.at_level(logging.WARNING, logger="unison.sync.transports.directory"):
        for _ in range(20):
            sub.poll()
    assert sub.receiver.version == 1 and bits_equal(sub.receiver.params, trainer)
    assert [r.getMessage().split()[1].rsplit("/", 1)[-1] for r in caplog.records] == ["0000000002.patch"]
    assert not pub.needs_anchor()  # a folder under requests/ is not a request
    for v in range(3, 20):  # the prune passes over the folder
        pub.publish(encode(anchor_patch(trainer, v)), v, anchor=True)
    assert (tmp_path / "sync" / "0000000002.patch").is_dir()
    assert len(list((tmp_path / "sync").glob("*.*"))) == 17  # the folder, and the 16 newest files


def test_an_unreadable_patch_file_is_retried_not_refused_for_good(tmp_path, caplog, monkeypatch):
    trainer, url, pub = published(tmp_path, versions=(0, 1))
    sub = DirectorySource(url, Receiver(weights(seed=1)))
    real_open, blocked = sub.fs.open, [True]

    def flaky_open(path, *args, **kwargs):
        if path.endswith("0000000001.patch") and blocked[0]:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(sub.fs, "open", flaky_open)  # fsspec shares the instance: undone after the test
    with caplog.at_level(logging.WARNING, logger="unison.sync.transports.directory"):
        for _ in range(5):
            sub.poll()
    assert sub.receiver.version == 0 and sub.receiver.counts["rejected"] == 0
    assert len([r for r in caplog.records if "0000000001.patch" in r.getMessage()]) == 1
    blocked[0] = False
    assert sub.poll() == 1 and sub.receiver.version == 1 and bits_equal(sub.receiver.params, trainer)


def test_a_waiting_server_asks_for_an_anchor_at_most_every_few_seconds(tmp_path, monkeypatch):
    url = str(tmp_path / "sync")
    pub = DirectorySender(url)
    sub = DirectorySource(url, Receiver(weights()))  # asks at most every 5 s by default
    sub.poll()
    assert pub.needs_anchor()  # consumed
    for _ in range(50):
        sub.poll()
    assert not pub.needs_anchor()  # not rewritten 50 times within the 5 s
    trainer = weights()
    pub.publish(encode(anchor_patch(trainer, 0)), 0, anchor=True)
    pub.publish(encode(sparse_patch(trainer, step(trainer, 2), 1, 2)), 2, anchor=False)  # 0 -> 1 went missing
    sub.poll()
    assert sub.receiver.version == 0 and pub.needs_anchor()  # another version reported: asked at once
    later = time.monotonic() + 5
    monkeypatch.setattr(directory.time, "monotonic", lambda: later)
    sub.poll()
    assert pub.needs_anchor()  # and again once the 5 s are up


def test_a_refused_file_is_read_once(tmp_path):
    trainer, url, pub = published(tmp_path)
    pub.publish(b"garbage", 1, anchor=False)
    sub = DirectorySource(url, Receiver(weights(seed=1)))
    for _ in range(10):
        sub.poll()
    assert sub.receiver.counts["rejected"] == 1 and sub.wants_anchor and sub.receiver.version == 0
    pub.publish(encode(anchor_patch(trainer, 1)), 1, anchor=True)  # what the trainer answers the request with
    assert sub.poll() == 1 and not sub.wants_anchor and sub.receiver.version == 1


def test_a_restarted_trainer_is_followed_through_the_directory(tmp_path):
    first, url, _ = published(tmp_path, versions=(0, 1, 2, 3))
    sub = DirectorySource(url, Receiver(weights(seed=1)))
    sub.poll()
    assert sub.receiver.version == 3 and bits_equal(sub.receiver.params, first)
    second = weights(seed=5)  # the run started again, from other weights, at version 0
    pub = DirectorySender(url)
    pub.publish(encode(anchor_patch(second, 0, restart=True)), 0, anchor=True, restart=True)
    assert sorted(p.name for p in (tmp_path / "sync").glob("0*")) == ["0000000000.anchor"]  # the old run's gone
    assert sub.poll() == 1 and sub.receiver.version == 0 and bits_equal(sub.receiver.params, second)
    pub.publish(encode(sparse_patch(second, step(second, 1), 0, 1)), 1, anchor=False)
    assert sub.poll() == 1 and sub.receiver.version == 1 and bits_equal(sub.receiver.params, second)
    assert sub.poll() == 0 and sub.receiver.counts["anchors"] == 2  # the restart anchor is applied once


def test_the_publisher_answers_a_servers_request_through_the_directory(tmp_path):
    """The WeightPublisher over sync.transport=fsspec: a server's request gets an anchor at the next sync, and a sync
    that is an anchor already answers it without a second one."""
    url = str(tmp_path / "sync")
    params = weights()
    publisher = WeightPublisher(SyncConfig(mode="sparse", transport="fsspec", servers=["http://unused"],
                                           fsspec=FsspecConfig(url)), params)
    sub = DirectorySource(url, Receiver(weights(seed=1)))
    assert publisher.anchor(version=0)["sync/anchors"] == 0
    sub.poll()
    assert sub.receiver.version == 0 and bits_equal(sub.receiver.params, params)
    publisher.after_step(1, step(params, 1))
    (tmp_path / "sync" / "0000000001.patch").unlink()  # lost: the server asks for an anchor
    publisher.after_step(2, step(params, 2))
    sub.poll()
    assert sub.wants_anchor and sub.receiver.version == 0
    assert publisher.after_step(3, step(params, 3))["sync/anchors"] == 1
    assert sub.poll() == 1 and sub.receiver.version == 3 and bits_equal(sub.receiver.params, params)
    (tmp_path / "sync" / "requests" / "server").write_text("3")  # a request the next anchor answers
    publisher.cfg.mode = "full"
    assert publisher.after_step(4, step(params, 4))["sync/anchors"] == 0
    assert not list((tmp_path / "sync" / "requests").iterdir())  # consumed


def test_dist_sync_needs_its_address():  # (the old sync.url key: tests/test_config.py)
    from unison.config import ConfigError, load_config
    from unison.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"sync\.transport=dist needs sync\.dist\.init_method"):
        load_config(TrainConfig, None, ["--sync.mode=sparse", "--sync.transport=dist", "--sync.servers=[http://a]"])


# The trainer over HTTP


class StubServer:
    """Answers each POST to /v1/weights with the next of ``statuses`` (then 200), keeping the bodies."""

    def __init__(self, statuses):
        self.statuses, self.bodies = list(statuses), []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                stub.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                status = stub.statuses.pop(0) if stub.statuses else 200
                body = json.dumps({"error": f"stub {status}"}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def stub(request):
    server = StubServer(getattr(request, "param", []))
    yield server
    server.close()


def publisher_for(url: str) -> tuple[WeightPublisher, dict[str, torch.Tensor]]:
    params = weights()
    return WeightPublisher(SyncConfig(mode="sparse", transport="http", servers=[url], timeout_s=10), params), params


@pytest.mark.parametrize("stub", [[400], [409]], indirect=True)
def test_a_server_that_refuses_the_trainers_patch_gets_an_anchor(stub):
    publisher, params = publisher_for(stub.url)
    metrics = publisher.after_step(1, step(params, 1))
    assert metrics["sync/anchors"] == 1 and len(stub.bodies) == 2
    sent, anchor = decode(stub.bodies[0]), decode(stub.bodies[1])
    assert not sent.anchor and anchor.anchor and anchor.version == 1 and not anchor.restart


def test_the_initial_anchor_is_a_restart(stub):
    publisher, _ = publisher_for(stub.url)
    publisher.anchor(version=0)
    assert decode(stub.bodies[0]).restart and decode(stub.bodies[0]).anchor


@pytest.mark.parametrize("stub", [[401], [403]], indirect=True)
def test_a_missing_or_wrong_token_is_named(stub):
    publisher, _ = publisher_for(stub.url)
    with pytest.raises(RuntimeError, match=r"sync\.token.*UNISON_SYNC_TOKEN"):
        publisher.anchor(version=0)


def test_an_unreachable_server_is_an_input_error_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket closes
    publisher, _ = publisher_for(url)
    with pytest.raises(InputError, match=url):
        publisher.anchor(version=0)
