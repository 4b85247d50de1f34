"""Sparse weight sync: the codec, the receiver's checks, the AdamW-inversion detector, the directory channel."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama

from unison.sync import Framed, PatchError, Receiver, anchor_patch, apply, checksum, decode, encode, frame, sparse_patch
from unison.sync.codec import _decode_indices, _encode_indices
from unison.sync.masks import adamw_inversion_mask
from unison.sync.transports import DirectorySender, DirectorySource
from unison.train.optimizer import MasterAdamW, OptimConfig


def trainer_and_copy(seed_copy: int = 1):
    """A bf16 tiny model with an fp32-master optimizer, and a differently initialised copy to sync into."""
    model, copy = tiny_llama(dtype=torch.bfloat16), tiny_llama(seed=seed_copy, dtype=torch.bfloat16)
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=3e-3), total_steps=100)
    return model, copy, opt


def train_one(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def state(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters()}


def test_index_encodings_round_trip():
    # Gaps above the signed range (40000 in 16 bits, 3e9 in 32) are stored as wrapped bits and must come back.
    for idx in (torch.tensor([0, 3, 65000, 65536 + 70000]), torch.tensor([5, 5 + 2**20]),
                torch.tensor([2**33 + 1]), torch.arange(0, 100000, 7), torch.tensor([40000, 40000 + 65535]),
                torch.tensor([7, 7 + 3_000_000_000, 7 + 2 * 3_000_000_000])):
        encoding, stored = _encode_indices(idx)
        assert torch.equal(_decode_indices(stored, encoding), idx), encoding
    assert _encode_indices(torch.tensor([40000, 40000 + 65535]))[0] == "gap16"
    assert _encode_indices(torch.tensor([7, 7 + 3_000_000_000]))[0] == "gap32"
    assert _encode_indices(torch.arange(0, 1000, 3))[0] == "gap16"
    assert _encode_indices(torch.tensor([1, 2**20]))[0] == "gap32"


def test_sparse_patches_keep_a_copy_bit_identical_and_carry_only_changes():
    model, copy, opt = trainer_and_copy()
    receiver = Receiver(state(copy))
    assert receiver.receive(encode(anchor_patch(state(model), version=0)))
    for step in range(1, 6):
        train_one(model, opt, step)
        patch = sparse_patch(state(model), opt.changed_masks, base_version=step - 1, version=step)
        changed = sum(int(m.sum()) for m in opt.changed_masks.values())
        total = sum(m.numel() for m in opt.changed_masks.values())
        assert patch.num_elements == changed < total  # only what changed travels
        assert receiver.receive(encode(patch))
    assert receiver.version == 5 and receiver.counts["patches"] == 5
    for name, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), dict(copy.named_parameters())[name].view(torch.int16)), name


def test_every_fault_is_caught_and_repaired_by_an_anchor():
    model, copy, opt = trainer_and_copy()
    receiver = Receiver(state(copy))
    receiver.receive(encode(anchor_patch(state(model), version=0)))
    patches = {}
    for step in range(1, 4):
        train_one(model, opt, step)
        patches[step] = sparse_patch(state(model), opt.changed_masks, base_version=step - 1, version=step)
    before = {n: p.clone() for n, p in copy.named_parameters()}

    # A dropped patch: 2 arrives while the receiver holds 0.
    assert not receiver.receive(encode(patches[2]))
    assert receiver.needs_anchor and "does not apply to version 0" in receiver.last_error
    assert not receiver.receive(encode(patches[1]))  # no sparse patch until an anchor
    assert receiver.counts["skipped_until_anchor"] == 1
    # Corrupted bytes, a wrong base version, an out-of-bounds index, a tampered value: each rejected.
    receiver = Receiver(state(copy), version=0)
    blob = bytearray(encode(patches[1]))
    blob[len(blob) // 2:len(blob) // 2 + 64] = bytes(64)
    faults = {"corrupt": bytes(blob[:len(blob) - 10]), "base": encode(patches[2])}
    name = next(iter(patches[1].indices))
    oob = decode(encode(patches[1]))
    oob.indices[name] = oob.indices[name].clone()
    oob.indices[name][-1] = copy.get_parameter(name).numel()
    faults["bounds"] = encode(oob)
    tampered = decode(encode(patches[1]))
    tampered.values[name] = tampered.values[name] + 1
    faults["checksum"] = encode(tampered)
    for kind, bad in faults.items():
        receiver = Receiver(state(copy), version=0)
        assert not receiver.receive(bad), kind
        # A missed version or a mismatch needs an anchor; a patch refused before any write changes nothing else.
        assert receiver.needs_anchor == (kind in ("base", "checksum")), kind
        if kind != "checksum":  # rejected before anything was written
            assert all(torch.equal(p, before[n]) for n, p in copy.named_parameters()), kind
    # The anchor repairs: the copy equals the trainer, and later patches apply again.
    assert receiver.receive(encode(anchor_patch(state(model), version=3)))
    assert receiver.version == 3 and not receiver.needs_anchor
    train_one(model, opt, 4)
    assert receiver.receive(encode(sparse_patch(state(model), opt.changed_masks, 3, 4)))
    assert all(checksum(p) == checksum(model.get_parameter(n)) for n, p in copy.named_parameters())


def test_apply_names_what_is_wrong():
    params = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    with pytest.raises(PatchError, match="dtype"):
        apply(params, anchor_patch({"w": torch.zeros(4)}, 1), 0)
    with pytest.raises(PatchError, match="unknown"):
        apply(params, anchor_patch({"v": torch.zeros(4, dtype=torch.bfloat16)}, 1), 0)
    with pytest.raises(PatchError, match="unreadable"):
        decode(b"\x00" * 20)


@pytest.mark.parametrize("lr,weight_decay", [(1e-3, 0.0), (1e-5, 0.0), (1e-4, 0.1)])
def test_adamw_inversion_detector_never_misses(lr, weight_decay):
    """torch.optim.AdamW stepping bf16 parameters directly, 200 steps with a decaying lr: the detector's mask
    against a snapshot diff. Misses must be 0; extras are counted and bounded."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(4000, generator=g) * 0.05).to(torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    misses = extras = changed = 0
    for step in range(1, 201):
        p.grad = (torch.randn(4000, generator=g) * (0.01 if step % 7 else 1.0)).to(torch.bfloat16)
        before = p.detach().clone()
        used_lr = opt.param_groups[0]["lr"]  # read before the scheduler moves it
        opt.step()
        sched.step()
        truth = before.view(torch.int16) != p.detach().view(torch.int16)
        s = opt.state[p]
        found = adamw_inversion_mask(p.detach(), s["exp_avg"], s["exp_avg_sq"], step=step, lr=used_lr, beta1=0.9,
                                     beta2=0.999, eps=1e-8, weight_decay=weight_decay)
        misses += int((truth & ~found).sum())
        extras += int((found & ~truth).sum())
        changed += int(truth.sum())
    assert changed > 0 and misses == 0
    assert extras < 0.2 * changed


def test_directory_channel_with_faults(tmp_path):
    """Publisher and subscriber over a local directory: a dropped patch and a corrupted one each make the
    subscriber ask for an anchor; the publisher answers at its next sync; the copy ends bit-identical."""
    model, copy, opt = trainer_and_copy()
    url = str(tmp_path / "sync")
    pub = DirectorySender(url)
    sub = DirectorySource(url, Receiver(state(copy)))
    pub.publish(encode(anchor_patch(state(model), 0)), 0, anchor=True)
    assert sub.poll() == 1 and sub.receiver.version == 0
    for step in range(1, 8):
        train_one(model, opt, step)
        blob = encode(sparse_patch(state(model), opt.changed_masks, step - 1, step))
        if step == 3:
            continue  # dropped
        if step == 6:
            blob = blob[:-100]  # truncated in transit
        pub.publish(blob, step, anchor=False)
        if pub.needs_anchor():
            pub.publish(encode(anchor_patch(state(model), step)), step, anchor=True)
        sub.poll()
    assert sub.receiver.counts["rejected"] == 2 and sub.receiver.counts["anchors"] == 3
    assert sub.receiver.version == 7
    assert all(checksum(p) == checksum(model.get_parameter(n)) for n, p in copy.named_parameters())


def test_framed_patches_round_trip_and_reject_bad_headers():
    model, _, opt = trainer_and_copy()
    params = state(model)
    train_one(model, opt, 0)
    for patch in (sparse_patch(params, opt.changed_masks, 0, 1, to_host=False), anchor_patch(params, 1)):
        framed = frame(patch)
        assert all(part.dtype == torch.uint8 for part in framed.parts) and framed.nbytes < len(encode(patch)) + 4096
        back = decode(framed)
        assert (back.base_version, back.version, back.anchor, back.checksums) == \
            (patch.base_version, patch.version, patch.anchor, patch.checksums)
        for name, values in patch.values.items():
            assert torch.equal(back.values[name].view(torch.int16), values.view(torch.int16)), name
            if not patch.anchor:
                assert torch.equal(back.indices[name], patch.indices[name]), name
    header = json.loads(framed.header)
    header["tensors"][0][2] = [header["tensors"][0][2][0] + 1, *header["tensors"][0][2][1:]]  # more than arrived
    with pytest.raises(PatchError, match="does not fit"):
        decode(Framed(json.dumps(header).encode(), framed.parts))
    with pytest.raises(PatchError, match="arrived"):
        decode(Framed(framed.header, framed.parts[:-1]))
    with pytest.raises(PatchError, match="unreadable"):
        decode(Framed(b"{not json", framed.parts))
