"""What the LoRA trains: its peft config, the vocabulary matrices (tied or not), and the adapter dir.

The LoRA goes on the linear layers ``model.lora.target_modules`` names, and optionally on the input
embeddings and the output projection (``train_embeddings``, ``train_head``; see ``lora_config``).
Its parameters are the only trainable ones, kept in fp32 whatever the compute dtype.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from agl.config import LoraConfig as LoraSection
from agl.config import typed
from agl.errors import ConfigError

if TYPE_CHECKING:
    import peft


def find_adapter_dir(adapter: str) -> Path:
    """Accept an adapter dir itself, or a run dir holding one (``<run>/adapter``); anything else is one
    ``ConfigError`` line saying what the path is instead."""
    path = Path(adapter).expanduser()
    if path.is_file():
        raise ConfigError(f"model.adapter '{adapter}' is a file, not an adapter dir or a run dir")
    for candidate in (path, path / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            if not (candidate / "adapter_model.safetensors").is_file():
                raise ConfigError(
                    f"model.adapter '{candidate}' has adapter_config.json but no adapter_model.safetensors "
                    "(an adapter being written, or copied in part)"
                )
            check_adapter_files(candidate)
            return candidate
    if (path / "store.sqlite").is_file():
        raise ConfigError(
            f"model.adapter '{adapter}' is a run dir without an adapter yet (its job has not finished: "
            f"python harness.py resume={adapter})"
        )
    raise ConfigError(f"model.adapter '{adapter}' holds no adapter_config.json (neither it nor '{path / 'adapter'}')")


def check_adapter_files(adapter_dir: Path) -> None:
    """A truncated or garbled adapter is one line naming the file, not peft's traceback from deep in loading.
    safetensors checks the header and that the data covers it (cheap: nothing is read into memory)."""
    config = adapter_dir / "adapter_config.json"
    try:
        json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"{config} is damaged (not JSON: {error}); restore the adapter from a copy") from None
    weights = adapter_dir / "adapter_model.safetensors"
    try:
        with safe_open(str(weights), "pt"):
            pass
    except SafetensorError as error:
        raise ConfigError(f"{weights} is damaged ({error}); restore the adapter from a copy") from None


# ----------------------------------------------------------------------------- what the LoRA trains


def lora_config(lora: LoraSection | Mapping[str, Any], base: torch.nn.Module) -> peft.LoraConfig:
    """The peft ``LoraConfig`` for ``model.lora``.

    ``target_modules`` picks linear layers (``all-linear``: every one but the output layer).
    ``train_embeddings`` adds a LoRA on the input embeddings and ``train_head`` one on the output
    projection, at the same rank. When the model ties the two (SmolLM2 does), they are one matrix:
    either option puts one LoRA on it, shared by both roles (peft's ``ensure_weight_tying``), so
    input and output stay tied. With both options off the config is exactly what it was before
    these options existed.

    Left out: training the full matrices (peft's ``modules_to_save``: vocabulary x hidden trainable
    parameters, 28M for SmolLM2 with three times that in AdamW state, in every checkpoint) and
    peft's ``trainable_token_indices`` (full rows for a chosen list of tokens: no list to choose here).
    """
    from peft import LoraConfig

    lora = typed(LoraSection, lora)
    extra = vocabulary_targets(base, lora.train_embeddings, lora.train_head)
    tie = {"ensure_weight_tying": True} if extra and ties_embeddings(base) else {}
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=with_targets(lora.target_modules, extra, base),
        task_type="CAUSAL_LM",
        **tie,
    )


def ties_embeddings(base: torch.nn.Module) -> bool:
    """True when the output projection computes with the input embedding matrix itself."""
    head = base.get_output_embeddings()
    return head is not None and head.weight is base.get_input_embeddings().weight


def module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def vocabulary_targets(base: torch.nn.Module, embeddings: bool, head: bool) -> list[str]:
    """Full names of the vocabulary matrices to put a LoRA on.

    Tied: the input embeddings' name for either option; peft then gives the output layer the
    same LoRA. Full names on purpose: a bare ``embed_tokens`` or ``lm_head`` in the target list
    makes peft's default save copy the base embedding matrices into every adapter.
    """
    tied = ties_embeddings(base)
    chosen = [base.get_input_embeddings()] if embeddings or (head and tied) else []
    if head and not tied:
        chosen.append(base.get_output_embeddings())
    return [module_name(base, module) for module in chosen]


def with_targets(target: Any, extra: list[str], base: torch.nn.Module) -> Any:
    """``model.lora.target_modules`` with the module names ``extra`` added.

    ``all-linear`` is expanded the way peft expands it (linear and Conv1D layers, the output
    layer excluded), since peft accepts ``all-linear`` only as the whole value; another string is
    a regex, extended by alternation; a list is extended. Without ``extra``, ``target`` is passed
    on unchanged.
    """
    from transformers.pytorch_utils import Conv1D

    if not extra:
        return target if isinstance(target, str) else list(target)
    if isinstance(target, str) and target.lower() == "all-linear":
        head = base.get_output_embeddings()
        linear = [
            name for name, m in base.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head
        ]
        return linear + extra
    if isinstance(target, str):
        return "|".join([f"(?:{target})", *(re.escape(name) for name in extra)])
    return list(target) + extra


def tied_lora_aliases(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(alias, owner) pairs of a LoRA shared by tied embeddings.

    peft ties the output layer's LoRA to the input embeddings' (``ensure_weight_tying``) by making
    the head's ``lora_A`` and ``lora_B`` new parameters over the transposed storage of the
    embeddings' ``lora_embedding_B`` and ``lora_embedding_A``: one matrix, two parameter objects.
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    if not (isinstance(head, LoraLayer) and isinstance(embed, LoraLayer) and ties_embeddings(base)):
        return []
    pairs = []
    for name, config in model.peft_config.items():
        if getattr(config, "ensure_weight_tying", False) and name in head.lora_A and name in embed.lora_embedding_A:
            pairs.append((head.lora_A[name].weight, embed.lora_embedding_B[name]))
            pairs.append((head.lora_B[name].weight, embed.lora_embedding_A[name]))
    return pairs


def check_vocabulary_tie(model: torch.nn.Module, lora: LoraSection) -> None:
    """Fail when tied embeddings were asked to train but peft did not share one LoRA between them."""
    import peft

    base = model.get_base_model()
    asked = lora.train_embeddings or lora.train_head
    if asked and ties_embeddings(base) and not tied_lora_aliases(model):
        raise ConfigError(
            f"model.lora.train_embeddings/train_head on a model with tied embeddings needs peft's "
            f"ensure_weight_tying for target_modules, which peft {peft.__version__} does not do; upgrade peft"
        )


def train_in_fp32(model: torch.nn.Module) -> None:
    """LoRA weights train in fp32 even when compute is bf16.

    Upcasting copies each parameter on its own (peft's autocast of a bf16 adapter does too), which
    would untie a tied LoRA; its aliases are then pointed back at their owners' storage.
    """
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    for alias, owner in tied_lora_aliases(model):
        alias.data = owner.data.t()


def fold_tied_gradients(model: torch.nn.Module) -> None:
    """Train a tied LoRA as one matrix: each alias's gradient is added to its owner's.

    The optimizer then steps each tied matrix once, with the summed gradient of both roles, as
    it would a tied base weight (``Policy.trainable_parameters`` skips the aliases). Without this,
    AdamW would step the shared storage twice, with two sets of moments and twice the weight decay.
    """
    for alias, owner in tied_lora_aliases(model):
        alias.register_post_accumulate_grad_hook(functools.partial(_fold_gradient, owner))


def _fold_gradient(owner: torch.nn.Parameter, alias: torch.nn.Parameter) -> None:
    grad = alias.grad.t().contiguous()
    owner.grad = grad if owner.grad is None else owner.grad.add_(grad)
    alias.grad = None


def resolve_train_merged(setting: Any, compute_dtype: torch.dtype) -> bool:
    """``model.lora.train_merged`` (agl.train.merged_lora): ``auto`` is on when the policy computes in float32."""
    if setting == "auto":
        return compute_dtype == torch.float32
    if not isinstance(setting, bool):
        raise ConfigError(f"model.lora.train_merged must be auto, true or false, not {setting!r}")
    return setting
