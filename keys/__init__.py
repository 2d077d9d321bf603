"""Canonical, versioned, tenant-namespaced keys for every store entry and Redis structure.

This package imports nothing else of diffcache: every other package builds on it.
"""

from keys.builders import (
    FIELD_POLICIES,
    ChainLink,
    FieldPolicy,
    Fingerprint,
    StepInputs,
    adapted,
    adapter_key,
    cfg_key,
    chain,
    chain_next,
    chain_root,
    embedding_key,
    file_digest,
    latents_key,
    model_fingerprint,
    output_key,
    tensor_digest,
)
from keys.canonical import canonical_bytes, digest
from keys.names import KEY_VERSION, InvalidTenantError, KeyKind, StoreKey, check_tenant
from keys.spec import (
    CfgCache,
    CfgMode,
    GenerationSpec,
    LoraUse,
    OutputFormat,
    Priority,
    PromptSegment,
    StepCache,
    StepCachePolicy,
)

__all__ = [
    "FIELD_POLICIES",
    "KEY_VERSION",
    "CfgCache",
    "CfgMode",
    "ChainLink",
    "FieldPolicy",
    "Fingerprint",
    "GenerationSpec",
    "InvalidTenantError",
    "KeyKind",
    "LoraUse",
    "OutputFormat",
    "Priority",
    "PromptSegment",
    "StepCache",
    "StepCachePolicy",
    "StepInputs",
    "StoreKey",
    "adapted",
    "adapter_key",
    "canonical_bytes",
    "cfg_key",
    "chain",
    "chain_next",
    "chain_root",
    "check_tenant",
    "digest",
    "embedding_key",
    "file_digest",
    "latents_key",
    "model_fingerprint",
    "output_key",
    "tensor_digest",
]
