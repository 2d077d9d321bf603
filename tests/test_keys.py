"""Keys are canonical, versioned and namespaced: golden vectors pin them across releases and
processes, and property tests show which inputs change them and which do not."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types

import pytest
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageImg2ImgPipeline
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

import keys
from keys import (
    FIELD_POLICIES,
    CfgCache,
    CfgMode,
    Fingerprint,
    GenerationSpec,
    KeyKind,
    LoraUse,
    Priority,
    PromptSegment,
    StepCache,
    StoreKey,
    adapted,
    canonical_bytes,
    cfg_key,
    chain_root,
    embedding_key,
    image_embedding_key,
    image_latent_key,
    image_mask_key,
    latents_key,
    model_fingerprint,
    names,
    output_key,
)
from keys.spec import SPEC_FIELDS, ImageInput, Reuse, ReuseMode, start_step
from workers.queue.messages import RefName, Role, Stage
from workers.queue.script_library import events_channel
from workers.stages.trajectory import chain_head, chain_links

ENCODER = model_fingerprint("text_encoder", {"d_model": 32}, {"model.safetensors": "ab"},
                            "float32", "cpu")
MODEL = model_fingerprint("transformer", {"layers": 2}, {"w.safetensors": "cd"}, "float32", "cpu")
DECODER = model_fingerprint("vae", {"base_dim": 16}, {"vae.safetensors": "ef"}, "float32", "cpu")
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "flow_shift": 3.0}
IMAGE_ENCODER = Fingerprint("vae-encode", "1" * 32)


def base_spec(**changes: object) -> GenerationSpec:
    fields = dict(request_id="r1", tenant="acme", prompt="a red fox", negative_prompt="blurry",
                  width=64, height=64, num_frames=9, num_inference_steps=4, guidance_scale=5.0,
                  seed=7, output_format="mp4", priority="interactive")
    fields.update(changes)
    return GenerationSpec.create(**fields)  # type: ignore[arg-type]


def fake_tokens(text: str) -> list[int]:
    """A stand-in tokenizer for key tests: distinct texts give distinct ids."""
    return list(text.encode("utf-8"))


def text_key(spec: GenerationSpec, text: str) -> StoreKey:
    ids = fake_tokens(text)
    return embedding_key(spec.tenant, ENCODER, ids, [1] * len(ids), 512)


def embedding_keys(spec: GenerationSpec) -> dict[RefName, StoreKey]:
    """The embeddings encode hands denoise: each segment's prompt, and its negative prompt
    where the segment uses guidance (the texts through a stand-in tokenizer)."""
    found = {}
    for i, segment in enumerate(spec.schedule):
        found[RefName(Role.PROMPT, i)] = text_key(spec, segment.prompt)
        if spec.segment_uses_cfg(segment):
            found[RefName(Role.NEGATIVE, i)] = text_key(spec, segment.negative_prompt)
    return found


def timesteps(spec: GenerationSpec) -> list[float]:
    return [1000.0 - 250.0 * i for i in range(spec.num_inference_steps)]


# What an image-embedding key is built from for a spec with no image: no strategy below draws
# this strength and mask together.
NO_IMAGE = ImageInput("e" * 32, 0.5, "e" * 32)


def all_keys(spec: GenerationSpec) -> dict[KeyKind, str]:
    """Every key a request derives, from the spec alone, through the functions the workers
    call: the chain is ``trajectory.chain_links``, so a change there changes these keys."""
    # The denoiser as the request runs it, adapters applied, as denoise and encode key it.
    model = adapted(MODEL, spec.loras)
    links = chain_links(spec, embedding_keys(spec), model, SCHEDULER, timesteps(spec),
                        image_encoder=IMAGE_ENCODER)
    first = spec.schedule[0]
    # The digest of the latent a step sees carries the trajectory so far: the chain head stands in.
    latent_digest = links[-1].hex
    return {
        KeyKind.EMBEDDING: "|".join(str(text_key(spec, t))
                                    for t in (first.prompt, first.negative_prompt)),
        # An edit's: each text read with its image (a stand-in where the spec has none).
        KeyKind.IMAGE_EMBEDDING: "|".join(
            str(image_embedding_key(spec.tenant, ENCODER, fake_tokens(t),
                                    spec.image or NO_IMAGE))
            for t in (first.prompt, first.negative_prompt)),
        KeyKind.CHECKPOINT: str(links[-1].checkpoint_key()),
        KeyKind.CFG: str(cfg_key(spec.tenant, model, text_key(spec, first.negative_prompt),
                                 timesteps(spec)[0], latent_digest)),
        KeyKind.LATENTS: str(latents_key(spec.tenant, spec.request_id, 1)),
        KeyKind.OUTPUT: str(output_key(links[-1], DECODER, spec.output_format)),
    }


# --- golden vectors ---------------------------------------------------------------------------

# Worked by hand from the layout in keys/canonical.py: L(2) s(1)"a" L(2) i(1)01 f(0.0).
GOLDEN_CANONICAL = ("4c0000000000000002" "730000000000000001" "61" "4c0000000000000002"
                    "690000000000000001" "01" "66" "0000000000000000")

# Pinned when the v1 format was written. A change here means every stored entry is orphaned:
# bump keys.KEY_VERSION rather than edit these.
GOLDEN_KEYS = {
    "embed": "v1:acme:embed:eba2fb8f96b5820396af37d57b0ddbad"
             "|v1:acme:embed:5e13209eeebf430066027b1b7ce1f897",
    "image_embed": "v1:acme:image_embed:614ae4132db405fc10df876227bfb94e"
                   "|v1:acme:image_embed:ed8557c8f8c5873d3b7030b3e88cf263",
    "ckpt": "v1:acme:ckpt:4-f4da553a6aa46ce60c8e36be4009aaa5",
    "cfg": "v1:acme:cfg:697d9d46eee3bebb395adcfe9dfd8b91",
    # Latents live between one denoise and one decode: never stored long enough to orphan.
    "latents": "v1:acme:latents:r1-1",
    "output": "v1:acme:output:41c44d80d6252d6d7e1ad1c93b7eb52a",
}


# h(0)..h(4) of ``base_spec``'s trajectory: the checkpoint keys' ids, and h(4) names its output.
GOLDEN_CHAIN = ["377845a7c129d82d8022a3010f1c5aa4", "26baefbb5d6aa28394cca35689751aaf",
                "42578fb116e2d04cf28a4e6a3488122f", "13b1609bdd250360c7f98a852f65578b",
                "f4da553a6aa46ce60c8e36be4009aaa5"]


def test_canonical_encoding_is_pinned() -> None:
    assert canonical_bytes(["a", [1, 0.0]]).hex() == GOLDEN_CANONICAL


def golden_keys() -> dict[str, str]:
    return {kind.value: value for kind, value in all_keys(base_spec()).items()}


def test_keys_match_golden_vectors() -> None:
    assert golden_keys() == GOLDEN_KEYS


def test_the_workers_chain_matches_its_golden_vector() -> None:
    spec = base_spec()
    links = chain_links(spec, embedding_keys(spec), MODEL, SCHEDULER, timesteps(spec))
    assert [link.hex for link in links] == GOLDEN_CHAIN
    assert [link.index for link in links] == list(range(spec.num_inference_steps + 1))
    assert links[0] == chain_root(spec, MODEL, SCHEDULER, "float32")
    # Encode names a cached output by the same head that denoise reaches.
    assert chain_head(spec, embedding_keys(spec), MODEL, SCHEDULER, timesteps(spec)) == links[-1]


def test_keys_are_identical_in_another_process() -> None:
    code = ("import json, tests.test_keys as t; "
            "print(json.dumps(t.golden_keys(), sort_keys=True))")
    # A different hash seed: nothing in a key may depend on Python's hash().
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout
    assert json.loads(out) == golden_keys()


def test_key_strings_are_versioned_and_namespaced() -> None:
    for kind, value in all_keys(base_spec()).items():
        for part in value.split("|"):
            version, tenant, kind_name, ident = part.split(":")
            assert (version, tenant, kind_name) == ("v1", "acme", kind.value)
            assert ident


# --- field coverage ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FIELD_POLICIES))
def test_every_spec_field_is_included_or_ignored(kind: KeyKind) -> None:
    policy = FIELD_POLICIES[kind]
    assert policy.uncovered == frozenset(), f"{kind}: add to includes or ignores"
    assert set(policy.ignores) <= SPEC_FIELDS and policy.includes <= SPEC_FIELDS


# --- properties -------------------------------------------------------------------------------

texts = st.text(alphabet="abcdefghij ", min_size=1, max_size=12)
CHANGES = {
    "request_id": st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
    "tenant": st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True),
    "schedule": texts.map(lambda p: (PromptSegment(p, "blurry", 4),)),
    "width": st.sampled_from([16, 32, 128]),
    "height": st.sampled_from([16, 32, 128]),
    "num_frames": st.sampled_from([1, 5, 13]),
    "num_inference_steps": st.sampled_from([1, 2, 3, 8]),
    "guidance_scale": st.floats(1.5, 20.0),
    "seed": st.integers(0, 2**63 - 1),
    "output_format": st.sampled_from(["png", "npy"]),
    "priority": st.sampled_from(["batch"]),
    # Only the approximate mode changes outputs; exact and off must share every key.
    "cfg_cache": st.sampled_from([CfgCache(CfgMode.INTERVAL, 2), CfgCache(CfgMode.INTERVAL, 5)]),
    # Any adapter, or the same adapter at another scale, is another denoiser.
    "loras": st.dictionaries(st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
                             st.floats(0.1, 2.0), min_size=1, max_size=3).map(
        lambda d: tuple(LoraUse(h, s) for h, s in sorted(d.items()))),
    # Every policy changes outputs, and so does each parameter of it.
    "step_cache": st.one_of(
        st.floats(0.01, 1.0).map(lambda t: StepCache.create("first_block", threshold=t)),
        st.integers(1, 9).map(lambda k: StepCache.create("taylorseer", interval=k))),
    # Starting from an image is another trajectory (which strengths share one: below).
    "image": st.one_of(
        st.builds(ImageInput, st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
                  st.one_of(st.none(), st.floats(0.01, 1.0))),
        st.builds(ImageInput, st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
                  st.floats(0.01, 1.0), st.from_regex(r"[0-9a-f]{32}", fullmatch=True))),
    "reuse": st.builds(Reuse, st.sampled_from(list(ReuseMode)), st.floats(0.01, 1.0),
                       st.floats(0.0, 0.99)),
}


def test_strategies_cover_the_spec() -> None:
    assert set(CHANGES) == SPEC_FIELDS


def changed(field: str, value: object) -> GenerationSpec:
    spec = base_spec()
    if field == "num_inference_steps":
        segment = spec.schedule[0]
        return dataclasses.replace(spec, num_inference_steps=value,
                                   schedule=(dataclasses.replace(segment, until_step=value),))
    return dataclasses.replace(spec, **{field: value})


@pytest.mark.parametrize("field", sorted(SPEC_FIELDS))
@given(data=st.data())
def test_included_fields_change_keys_and_ignored_ones_do_not(field: str,
                                                             data: st.DataObject) -> None:
    value = data.draw(CHANGES[field])
    before, after = all_keys(base_spec()), all_keys(changed(field, value))
    if getattr(base_spec(), field) == getattr(changed(field, value), field):
        return
    for kind, policy in FIELD_POLICIES.items():
        if field in policy.includes:
            assert before[kind] != after[kind], f"{kind} ignores included {field}={value!r}"
        else:
            assert before[kind] == after[kind], f"{kind} depends on ignored {field}={value!r}"


@given(st.dictionaries(st.text(max_size=5), st.integers(), min_size=2))
def test_dict_order_does_not_change_encoding(d: dict[str, int]) -> None:
    assert canonical_bytes(d) == canonical_bytes(dict(reversed(list(d.items()))))


@given(st.lists(st.one_of(st.none(), st.booleans(), st.integers(), st.text(), st.binary(),
                          st.floats(allow_nan=False)), max_size=4),
       st.lists(st.one_of(st.none(), st.booleans(), st.integers(), st.text(), st.binary(),
                          st.floats(allow_nan=False)), max_size=4))
def test_encoding_is_injective(a: list[object], b: list[object]) -> None:
    def tagged(xs: list[object]) -> list[tuple[str, object]]:
        # Python equates True with 1 and 0.0 with -0.0; the encoding must not.
        return [(type(x).__name__, repr(x)) for x in xs]

    assert (canonical_bytes(a) == canonical_bytes(b)) == (tagged(a) == tagged(b))


@given(st.from_regex(r"[a-z0-9][a-z0-9_-]{0,10}", fullmatch=True),
       st.from_regex(r"[a-z0-9][a-z0-9_-]{0,10}", fullmatch=True))
def test_tenant_namespaces_never_collide(a: str, b: str) -> None:
    ka, kb = text_key(base_spec(tenant=a), "x"), text_key(base_spec(tenant=b), "x")
    assert (str(ka) == str(kb)) == (a == b)
    assert StoreKey.parse(str(ka)) == ka


def test_bad_tenant_and_nan_are_rejected() -> None:
    with pytest.raises(keys.InvalidTenantError):
        StoreKey("Acme:1", KeyKind.OUTPUT, "x")
    with pytest.raises(keys.InvalidTenantError):
        StoreKey("_system", KeyKind.OUTPUT, "x")
    with pytest.raises(ValueError, match="NaN"):
        canonical_bytes(float("nan"))


def test_prompt_schedule_shares_the_chain_prefix() -> None:
    a = base_spec(schedule=(PromptSegment("fox", "blurry", 2), PromptSegment("cat", "blurry", 4)))
    b = base_spec(schedule=(PromptSegment("fox", "blurry", 2), PromptSegment("dog", "blurry", 4)))

    def links(spec: GenerationSpec) -> list[str]:
        return [link.hex for link in chain_links(spec, embedding_keys(spec), MODEL, SCHEDULER,
                                                 timesteps(spec))]

    la, lb = links(a), links(b)
    assert la[:3] == lb[:3]  # h0, h1, h2: the shared two steps
    assert la[3] != lb[3]


@given(st.integers(1, 60), st.floats(0.0, 1.0, exclude_min=True))
def test_an_image_trajectory_starts_where_the_diffusers_pipeline_starts(steps: int,
                                                                       strength: float) -> None:
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(steps)
    pipeline = types.SimpleNamespace(scheduler=scheduler)
    timesteps, left = QwenImageImg2ImgPipeline.get_timesteps(pipeline, steps, strength, "cpu")
    assert start_step(steps, strength) == steps - left
    assert timesteps.tolist() == scheduler.timesteps[start_step(steps, strength):].tolist()


def test_an_image_trajectory_is_named_by_its_image_start_and_encoder() -> None:
    def root(strength: float, encoder: Fingerprint = IMAGE_ENCODER,
             content_hash: str = "0" * 32, mask: str | None = None) -> str:
        spec = base_spec(num_inference_steps=20,
                         image=ImageInput(content_hash, strength, mask))
        return chain_root(spec, MODEL, SCHEDULER, "float32", image_encoder=encoder).hex

    # 0.61 and 0.62 of 20 steps both start at step 7: one trajectory, one set of keys.
    assert root(0.61) == root(0.62) != root(0.7)
    assert root(0.61) != root(0.61, content_hash="1" * 32)
    # An inpainting keeps to its mask at every step: each mask is its own trajectory.
    assert len({root(0.61), root(0.61, mask="a" * 32), root(0.61, mask="b" * 32)}) == 3
    assert root(0.61) != root(0.61, encoder=Fingerprint("vae-encode", "2" * 32))
    with pytest.raises(ValueError, match="encoder"):
        chain_root(base_spec(image=ImageInput("0" * 32)), MODEL, SCHEDULER, "float32")


def test_an_image_spec_refuses_what_it_cannot_run() -> None:
    image = ImageInput("0" * 32, strength=0.5)
    spec = base_spec(image=image)
    assert spec.first_step == 2
    with pytest.raises(ValueError, match="magcache"):
        base_spec(image=image, step_cache=StepCache.create("magcache", threshold=0.1))
    assert base_spec(image=image, step_cache=StepCache.create("taylorseer", interval=2))
    # diffusers truncates the steps left out, so only a strength lost in rounding runs none.
    assert base_spec(image=ImageInput("0" * 32, strength=0.01)).first_step == 3
    with pytest.raises(ValueError, match="leaves no step"):
        base_spec(image=ImageInput("0" * 32, strength=1e-20))
    with pytest.raises(ValueError, match="32 lowercase hex"):
        ImageInput("not-a-hash")
    with pytest.raises(ValueError, match="strength"):
        ImageInput("0" * 32, strength=0.0)
    with pytest.raises(ValueError, match=r"image\.mask"):
        ImageInput("0" * 32, strength=0.5, mask="not-a-hash")
    with pytest.raises(ValueError, match="image-to-image"):  # a mask keeps to a start image
        ImageInput("0" * 32, strength=None, mask="a" * 32)
    # An image that conditions every step (image-to-video) starts the trajectory at step 0.
    assert base_spec(image=ImageInput("0" * 32, strength=None)).first_step == 0
    # A branch shares steps the image trajectory ran, never those it skipped.
    tail = (PromptSegment("a grey wolf", "blurry", 4),)
    with pytest.raises(ValueError, match="from 3 to 3"):
        spec.branch("r2", 2, tail)
    assert spec.branch("r2", 3, tail).image == image


def test_exact_and_off_cfg_modes_share_every_key() -> None:
    assert all_keys(base_spec()) == all_keys(base_spec(cfg_cache=CfgCache(CfgMode.OFF)))


@pytest.mark.parametrize("tenant", ["acme\n", "acme:x", "", "_system", "Acme"])
def test_tenants_that_could_forge_a_key_are_rejected(tenant: str) -> None:
    with pytest.raises(keys.InvalidTenantError):
        keys.check_tenant(tenant)


@given(tenant=st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True),
       request_id=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True))
def test_every_key_a_queue_script_touches_hashes_to_the_queue_slot(tenant: str,
                                                                   request_id: str) -> None:
    """Redis Cluster runs a script only on keys of one slot, and ``take.lua`` builds record
    keys of its own: every queue key, whatever tenant and id it holds, is in ``{q}``'s slot."""
    record = names.request_record(tenant, request_id)
    queue_keys = [record, events_channel(record), names.request_index(tenant),
                  names.active_requests(), names.tenant_active_requests(tenant),
                  names.decode_credits(), names.rescued_requests(), names.dead_letter_stream(),
                  names.worker_inbox("denoise", f"w-{request_id}"),
                  *(names.stage_stream(s.value, p.value) for s in Stage for p in Priority),
                  *(names.stage_latency(s.value, p.value) for s in Stage for p in Priority)]
    assert {key_slot(k.encode()) for k in queue_keys} == {key_slot(names.QUEUE_TAG.encode())}
    # The served model and its tokenizers change in one transaction.
    assert key_slot(names.served_model().encode()) == key_slot(
        names.served_tokenizer(request_id).encode())


def test_an_unconditional_prediction_is_named_by_the_image_condition_it_took() -> None:
    """Image-to-video's unconditional rows take the image's condition as well: two images
    under the same seed and negative prompt start from the same latents, so the CFG key must
    tell them apart (and a text-only key stays as it was)."""
    negative = StoreKey("t", KeyKind.EMBEDDING, "0" * 32)
    one, two = (image_latent_key("t", MODEL, h * 32, (64, 64, 5)) for h in "12")
    plain = cfg_key("t", MODEL, negative, 999.0, "d")
    assert len({plain, cfg_key("t", MODEL, negative, 999.0, "d", one),
                cfg_key("t", MODEL, negative, 999.0, "d", two)}) == 3
    # The condition of a video of other length is another encoding.
    assert image_latent_key("t", MODEL, "1" * 32, (64, 64, 9)) != one


def test_a_mask_is_named_by_its_pixels_and_size_apart_from_any_image() -> None:
    mask = image_mask_key("t", MODEL, "1" * 32, 64, 64)
    assert mask.kind is KeyKind.IMAGE_MASK
    assert len({mask, image_mask_key("t", MODEL, "2" * 32, 64, 64),
                image_mask_key("t", MODEL, "1" * 32, 64, 96),
                image_mask_key("u", MODEL, "1" * 32, 64, 64)}) == 4
    # The same hash as an image's is another entry: a mask is no VAE encoding.
    assert str(mask) != str(image_latent_key("t", MODEL, "1" * 32, (64, 64, 1)))
