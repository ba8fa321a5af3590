"""Delta versions: the encoding round trip, the trainer's full-or-delta decision, the
explorer's rebuild and the chain it walks (pure: no broker, no store)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from streamrft.infra.config import Config, from_dict
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas.errors import IntegrityError, SyncError, VersionGone
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync import delta
from streamrft.sync.follower import delta_chain
from streamrft.sync.payload import DeltaPolicy, ModelWeights
from streamrft.sync.weights import nbytes
from tests.helpers.configs import cfg_of
from tests.helpers.paths import ADDITION


def _state(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(64, 129, generator=g).to(dtype),
        "few": torch.randn(1000, generator=g).to(dtype),
        "all": torch.randn(7, 5, generator=g).to(dtype),
        "same": torch.randn(33, generator=g).to(dtype),
        "scalar": torch.tensor(0.5).to(dtype),
        "steps": torch.arange(6, dtype=torch.int64),
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _changed(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    new = {k: v.clone() for k, v in base.items()}
    g = torch.Generator().manual_seed(1)
    many = torch.rand(new["big"].shape, generator=g) < 0.3
    new["big"] = torch.where(many, new["big"] * 1.5 + 0.25, new["big"])
    new["few"].view(-1)[[0, 17, 999]] += 1.0  # a few elements: indices
    new["all"] = new["all"] * 2 + 1  # every element: the tensor whole
    new["scalar"] = new["scalar"] + 1
    new["steps"] = new["steps"] + 1
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_trip_is_bit_identical_for_half_precision(dtype):
    base = _state(dtype)
    new = _changed(base)
    changes = delta.encode(new, base)
    # unchanged: nothing; a few: indices; many: a bit mask; all: whole
    assert not any(k.startswith("same") for k in changes)
    assert changes["few#idx"].tolist() == [0, 17, 999] and changes["few#val"].dtype == dtype
    assert "big#mask" in changes and changes["big#mask"].numel() == (64 * 129 + 7) // 8
    assert torch.equal(changes["all"], new["all"])
    assert nbytes(changes) < nbytes(new)
    rebuilt = delta.decode(changes, base)
    assert set(rebuilt) == set(new)
    for name in new:
        assert rebuilt[name].dtype == new[name].dtype
        assert _bits(rebuilt[name]) == _bits(new[name]), name
    assert delta.state_sha256(rebuilt) == delta.state_sha256(new)
    assert delta.state_sha256(rebuilt) != delta.state_sha256(base)
    assert torch.equal(base["few"], _state(dtype)["few"])  # the base is never written


def test_bits_not_values_are_compared():
    base = {"w": torch.zeros(100, dtype=torch.bfloat16)}
    base["w"][1] = float("nan")
    new = {"w": base["w"].clone()}
    new["w"][0] = -0.0
    changes = delta.encode(new, base)
    assert changes["w#idx"].tolist() == [0]  # -0.0 == 0.0 as values, not as bits; nan is
    rebuilt = delta.decode(changes, base)
    assert delta.state_sha256(rebuilt) == delta.state_sha256(new)
    assert delta.encode(base, base) == {}


def test_mask_packing_round_trip():
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 8, 9, 1001):
        bits = torch.rand(n, generator=g) < 0.5
        assert torch.equal(delta.unpack_mask(delta.pack_mask(bits), n), bits)


def test_a_delta_that_does_not_fit_its_base_is_an_integrity_error():
    base = _state(torch.bfloat16)
    changes = delta.encode(_changed(base), base)
    bad = dict(changes, **{"few#idx": torch.tensor([0, 17, 5000], dtype=torch.int32)})
    with pytest.raises(IntegrityError, match="does not fit"):
        delta.decode(bad, base)
    with pytest.raises(IntegrityError, match="incomplete"):
        delta.decode({k: v for k, v in changes.items() if k != "few#val"}, base)
    with pytest.raises(IntegrityError, match="not in the base"):
        delta.decode({"ghost#idx": torch.zeros(1, dtype=torch.int32)}, base)
    with pytest.raises(IntegrityError, match="sha256"):
        delta.verify_state(base, delta.state_sha256(_changed(base)), "v1")


def _tiny():
    cfg = Config()
    tok = build_char_tokenizer(cfg.model.charset)
    return build_tiny_model(cfg.model, tok), tok


def _adam_step(model: torch.nn.Module, tok, lr: float) -> None:
    """One real optimizer step: next-token loss on a few additions."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.tensor([tok.encode("3+4=7 2+2=4 9+0=9")])
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()


def _event(version: int, payload, weights: ModelWeights) -> ModelVersionReady:
    """What a transport's event would be, stamped as the publisher does."""
    ev = ModelVersionReady(
        version=version, method="filesystem", uri="x", manifest_sha256="", bytes=0, step=version
    )
    return weights.stamp(ev)


def test_float32_auto_falls_back_to_full_and_bf16_sends_a_delta():
    for dtype, lr, expect_delta in ((torch.float32, 1e-3, False), (torch.bfloat16, 1e-5, True)):
        model, tok = _tiny()
        policy = DeltaPolicy(always=False, full_every=10, max_ratio=0.5)
        weights = ModelWeights(model, lora=False, dtype=dtype, delta=policy)
        first = weights.payload(0, 0)
        full = {k: v.clone() for k, v in first.tensors.items()}
        assert _event(0, first, weights).delta_base == -1
        _adam_step(model, tok, lr)
        second = weights.payload(1, 1)
        ev = _event(1, second, weights)
        assert (ev.delta_base == 0) is expect_delta, dtype
        truth = {k: v.detach().to(dtype) for k, v in model.state_dict().items() if k in full}
        assert ev.state_sha256 == delta.state_sha256(truth)
        if expect_delta:
            assert nbytes(second.tensors) <= 0.5 * nbytes(full)
            rebuilt = delta.decode(second.tensors, full)
            assert delta.state_sha256(rebuilt) == ev.state_sha256
        else:
            assert set(second.tensors) == set(full)  # whole tensors


def test_an_unset_delta_is_auto_for_half_precision_and_never_for_float32(caplog):
    def policy(dtype: str, **sync):
        cfg = from_dict(cfg_of(synchronizer={"method": "object_store", **sync}))
        return DeltaPolicy.from_config(cfg.synchronizer, lora=False, dtype=dtype)

    for dtype in ("bfloat16", "float16"):
        auto = policy(dtype)
        assert auto is not None and not auto.always and auto.max_ratio == 0.5
        assert policy(dtype, delta="never") is None  # said on purpose: kept
    assert policy("float32") is None
    assert policy("float32", delta="always") == DeltaPolicy(True, 10, 0.5)
    # a method that sends whole tensors: none, and a warning only when delta was set
    whole = from_dict(cfg_of(synchronizer={"method": "shared"})).synchronizer
    with caplog.at_level("WARNING"):
        assert DeltaPolicy.from_config(whole, lora=False, dtype="bfloat16") is None
    assert "is ignored" not in caplog.text
    said = from_dict(cfg_of(synchronizer={"method": "auto", "delta": "auto"}))
    with caplog.at_level("WARNING"):
        assert DeltaPolicy.from_config(said.synchronizer, lora=False, dtype="bfloat16") is None
    assert "synchronizer.delta: auto is ignored: the auto method" in caplog.text


def test_on_sends_deltas_and_a_full_version_every_k():
    model, _ = _tiny()
    weights = ModelWeights(model, False, torch.bfloat16, delta=DeltaPolicy(True, 2, 0.5))
    bases = []
    for v in range(7):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # everything changes: still a delta with "always"
        payload = weights.payload(v, v)
        bases.append(_event(v, payload, weights).delta_base)
    assert bases == [-1, 0, 1, -1, 3, 4, -1]
    assert weights.payload(7, 7, must_be_full=True).tensors.keys() == weights._last.keys()
    assert weights.sent.delta_base == -1


def test_the_kept_base_does_not_follow_training():
    """float32 weights are sent without a cast (the payload is the model's own storage):
    the base kept for the next delta must be a copy, or every delta would be empty."""
    model, tok = _tiny()
    weights = ModelWeights(model, False, torch.float32, delta=DeltaPolicy(True, 10, 0.5))
    weights.payload(0, 0)
    _adam_step(model, tok, 1e-3)
    changes = weights.payload(1, 1).tensors
    assert nbytes(changes) > 0.9 * sum(p.numel() * 4 for p in model.parameters())


def test_explorer_rebuilds_on_what_it_holds_only():
    trainer_model, _ = _tiny()
    explorer_model, _ = _tiny()
    sent = ModelWeights(trainer_model, False, torch.bfloat16, delta=DeltaPolicy(True, 10, 0.5))
    got = ModelWeights(explorer_model.to(torch.bfloat16), False)
    v0 = sent.payload(0, 0)
    ev0 = _event(0, v0, sent)
    got.apply(ev0, v0.tensors)
    assert got.held_version == 0
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.view(-1)[::7] += 0.5
    v1 = sent.payload(1, 1)
    ev1 = _event(1, v1, sent)
    rebuilt = got.rebuild(ev1, v1.tensors)
    delta.verify_state(rebuilt, ev1.state_sha256, "v1")
    got.apply(ev1, rebuilt)
    for name, t in explorer_model.state_dict().items():
        assert torch.equal(t, trainer_model.state_dict()[name].to(torch.bfloat16)), name
    with pytest.raises(SyncError, match="holds 1"):
        got.rebuild(msgspec.structs.replace(ev1, version=2, delta_base=0), {})
    # without state_sha256 (the trainer sends no deltas) nothing is held
    plain = ModelWeights(_tiny()[0], False)
    plain.apply(msgspec.structs.replace(ev0, state_sha256=""), v0.tensors)
    assert plain.held is None


def _ev(version: int, base: int) -> ModelVersionReady:
    return ModelVersionReady(
        version=version,
        method="object_store",
        uri="x",
        manifest_sha256="",
        bytes=0,
        step=version,
        delta_base=base,
    )


def test_delta_chain_from_what_is_held_or_from_the_newest_full():
    versions = {
        0: _ev(0, -1),
        1: _ev(1, 0),
        2: _ev(2, 1),
        3: _ev(3, -1),
        4: _ev(4, 3),
        5: _ev(5, 4),
    }
    chain = lambda target, held: [e.version for e in delta_chain(versions, target, held)]  # noqa: E731
    assert chain(2, 1) == [2]  # the next delta on what is held
    assert chain(2, 0) == [1, 2]  # missed one: the deltas since
    assert chain(2, -1) == [0, 1, 2]  # joined late: the full version, then the deltas
    assert chain(5, 1) == [3, 4, 5]  # held is not on the way back: from the full version
    assert chain(3, 2) == [3]  # a full version is itself
    del versions[1]
    with pytest.raises(SyncError, match="never announced"):
        chain(2, -1)
    # the target itself retired meanwhile (a background rebuild outlived it): gone, which
    # the failure policy answers by choosing again, never a rejection or a crash
    for held in (-1, 4):
        with pytest.raises(VersionGone, match="version 6 was retired"):
            chain(6, held)


def test_tensors_of_any_width_go_whole_and_a_lost_tensor_is_a_sync_error():
    """A dtype wider than 8 bytes cannot be compared as integers: whole, not a crash; a
    tensor gone since the base cannot be said by a delta (an error of the project's tree,
    which the trainer answers with a full version)."""
    base = {"c": torch.randn(4, dtype=torch.complex128), "w": torch.zeros(64).bfloat16()}
    new = {"c": base["c"] * 2, "w": base["w"].clone()}
    new["w"][3] = 1
    changes = delta.encode(new, base)
    assert torch.equal(changes["c"], new["c"]) and changes["w#idx"].tolist() == [3]
    assert delta.state_sha256(delta.decode(changes, base)) == delta.state_sha256(new)
    with pytest.raises(SyncError, match="gone since the base"):
        delta.encode({"w": new["w"]}, base)
    with pytest.raises(SyncError, match="separator"):
        delta.encode({"a#b": new["w"]}, {})


def test_a_malformed_delta_is_an_integrity_error_not_a_crash():
    """Entries of the wrong size or shape raise IntegrityError (a version the explorer
    rejects), never a bare torch error that would end the explorer's loop."""
    base = {"w": torch.zeros(100, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][::2] = 1  # half changed: a bit mask
    changes = delta.encode(new, base)
    assert set(changes) == {"w#mask", "w#val"}
    short = dict(changes, **{"w#mask": changes["w#mask"][:-2]})
    wide = dict(changes, **{"w#mask": changes["w#mask"].to(torch.int32)})
    tall = {"w#idx": torch.tensor([1, 2, 3], dtype=torch.int32), "w#val": new["w"][:3, None]}
    floats = {"w#idx": torch.tensor([1.0, 2.0]), "w#val": new["w"][:2]}
    for bad in (short, wide, tall, floats):
        with pytest.raises(IntegrityError, match="does not fit"):
            delta.decode(bad, base)


def test_the_publisher_makes_a_delta_payload_off_the_event_loop(tmp_path):
    """Comparing, hashing and copying a large model takes seconds: done on the event loop it
    would stall the trainer's heartbeats and its consumer group's. Real filesystem store."""
    import asyncio
    import threading

    from streamrft.infra.bus import Counters
    from streamrft.infra.config import from_dict
    from streamrft.sync.publisher import VersionPublisher
    from streamrft.sync.transport import SenderContext, make_sender

    cfg = from_dict(
        {
            "run": {"name": "t", "id": "t-delta", "dir": str(tmp_path / "runs")},
            "synchronizer": {"method": "filesystem", "fs_dir": str(tmp_path / "v")},
            "taskset": {"path": str(ADDITION)},
        }
    )
    on_loop: list[bool] = []

    class Weights(ModelWeights):
        def payload(self, version, step, must_be_full=False, frozen=None):
            on_loop.append(threading.current_thread() is threading.main_thread())
            return super().payload(version, step, must_be_full, frozen)

    model, tok = _tiny()
    weights = Weights(model, False, torch.bfloat16, delta=DeltaPolicy(True, 10, 0.5))
    announced: list[ModelVersionReady] = []

    async def announce(event: ModelVersionReady) -> None:
        announced.append(event)

    async def scenario() -> None:
        sender = make_sender(cfg, SenderContext(Counters(), lambda: []))
        publisher = VersionPublisher(weights, sender, announce, Counters())
        try:
            await publisher.publish(0)
            _adam_step(model, tok, 1e-5)
            await publisher.publish(1)
        finally:
            publisher.close()

    asyncio.run(scenario())
    assert on_loop == [False, False]
    assert [e.delta_base for e in announced] == [-1, 0]
    truth = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert announced[1].state_sha256 == delta.state_sha256({k: truth[k] for k in weights._last})


def test_the_state_an_explorer_holds_does_not_pin_fetched_shards(tmp_path):
    """A fetched version's tensors are views of its shard buffers: once a delta replaced
    most of them, the unchanged ones kept as the next base must not keep whole shards alive
    (the explorer would hold up to twice the model). Real filesystem store."""
    from streamrft.sync.filesystem import FilesystemLoader, FilesystemPublisher

    state = {f"w{i}": torch.randn(256, 64).bfloat16() for i in range(4)}
    state["norm"] = torch.ones(64).bfloat16()
    publisher = FilesystemPublisher(tmp_path, "run", 1 << 20)  # one shard for everything
    ev0 = msgspec.structs.replace(publisher.publish(state, 0, 0), state_sha256="x")
    fetched = FilesystemLoader(tmp_path).fetch(ev0)
    assert fetched["norm"].untyped_storage().nbytes() > fetched["norm"].nbytes  # a view
    explorer = ModelWeights(_tiny()[0], False, target=_NoTarget())
    explorer.apply(ev0, fetched)
    new = {k: (v + 1 if k != "norm" else v) for k, v in state.items()}
    ev1 = msgspec.structs.replace(ev0, version=1, delta_base=0, state_sha256="y")
    explorer.apply(ev1, explorer.rebuild(ev1, delta.encode(new, state)))
    assert delta.state_sha256(explorer.held) == delta.state_sha256(new)
    kept = sum(t.untyped_storage().nbytes() for t in explorer.held.values())
    assert kept == nbytes(new), (kept, nbytes(new))


class _NoTarget:
    """An engine that takes whatever it is given (the held state is what is checked)."""

    def load_weights(self, version: int, tensors) -> None:
        pass

    def load_adapter(self, version: int, tensors) -> None:
        pass


def test_the_wire_takes_a_delta_event_and_refuses_a_base_that_is_not_earlier():
    """The new fields decode from the control topic's bytes (and default when absent, as
    from an older trainer); a delta base at or above the version could make a loop."""
    from streamrft.schemas.codec import CONTROL
    from streamrft.schemas.errors import SchemaError
    from streamrft.schemas.events import validate_control

    ev = msgspec.structs.replace(_ev(5, 4), state_sha256="ab" * 32)
    back = CONTROL.decode(CONTROL.encode(ev))
    assert (back.delta_base, back.state_sha256) == (4, "ab" * 32)
    old = msgspec.json.encode(
        {
            k: v
            for k, v in msgspec.to_builtins(ev).items()
            if k not in ("delta_base", "state_sha256")
        }
    )
    assert msgspec.json.decode(old, type=ModelVersionReady).delta_base == -1
    for base in (5, 6, -2):
        with pytest.raises(SchemaError, match="delta_base"):
            validate_control(msgspec.structs.replace(ev, delta_base=base))
    with pytest.raises(SchemaError, match="sha256"):
        validate_control(msgspec.structs.replace(ev, state_sha256="a" * 129))


def test_a_delta_event_of_an_adapter_or_without_the_state_digest_is_refused_on_the_wire():
    """An explorer could not check such a delta: refused when decoded, not after a fetch."""
    from streamrft.schemas.errors import SchemaError
    from streamrft.schemas.events import validate_control

    ev = msgspec.structs.replace(_ev(5, 4), state_sha256="ab" * 32)
    assert validate_control(ev) is ev
    for bad in (
        msgspec.structs.replace(ev, lora=True),
        msgspec.structs.replace(ev, state_sha256=""),
    ):
        with pytest.raises(SchemaError, match="full weights and carries state_sha256"):
            validate_control(bad)
