"""The DSpine training objective: a drafter trained against a frozen target's head and final states.

Per supervised proposal (weight w, position-decayed):
    ce_weight * CE + (1 - ce_weight) * L1(draft, teacher)           backbone terms
  + ce_weight * refCE + (1 - ce_weight) * refL1                     top-k refinement through ``refine``
  + beta * CE_global * sum_l (1 - cos(feature_l, code(label)))      alignment, beta on a warm-up schedule
and the loss is sum(numerator) / max(sum w, 1). CE_global is the detached, globally reduced weighted mean CE
(one all-reduce), or a value handed in by the accumulation driver.

A batch without any anchor (no two consecutive supervised tokens in a document: prompt-only or padding rows) draws
nothing and contributes nothing: its loss is 0 with every gradient 0 (not NaN), as this package's causal-LM losses
give for a batch whose labels are all ignored. Its output still carries a graph through every trainable parameter,
so that a data-parallel backward reduces the same gradients on every rank.
"""

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from liger_dspine.models.dspine.blocks import block_targets
from liger_dspine.models.dspine.blocks import max_valid_anchor_count
from liger_dspine.models.dspine.blocks import noise_token_ids
from liger_dspine.models.dspine.blocks import sample_anchor_positions
from liger_dspine.models.dspine.blocks import teacher_positions
from liger_dspine.models.dspine.chunking import checkpointed_chunk_reduce
from liger_dspine.models.dspine.frozen_head_terms import frozen_head_terms
from liger_dspine.models.dspine.masks import draft_attention_masks
from liger_dspine.models.dspine.masks import draft_position_ids

logger = logging.getLogger(__name__)

DEFAULT_LOSS_DECAY_GAMMA = 7.0
BACKBONE_CE = "dspine/backbone_ce"


@dataclass
class DSpineObjectiveOutput:
    """loss: numerator / max(D, 1); accuracy: correct / max(count, 1).

    ratio_metrics: name -> (numerator, denominator), summable across micro-batches and ranks.
    accuracy_denom: count of supervised proposals (unweighted).
    loss_terms: (numerator, D), D the weighted count of supervised proposals.
    alignment_ce: the CE_global used for the alignment scale (None on the CE-only path).
    """

    loss: torch.Tensor
    accuracy: torch.Tensor
    ratio_metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]
    accuracy_denom: torch.Tensor
    loss_terms: tuple[torch.Tensor, torch.Tensor]
    alignment_ce: torch.Tensor | None = None


def refinement_terms(
    refined: torch.Tensor,
    candidate_ids: torch.Tensor,
    candidate_teacher_probs: torch.Tensor,
    labels: torch.Tensor,
    head_weight: torch.Tensor,
    ce_weight: float,
    mass_threshold: float,
    lean_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refinement loss over the K candidates of each proposal.

    Args:
        refined: [..., H] ``refine(pre_injection, true predecessor)``.
        candidate_ids: [..., K]; candidate_teacher_probs: [..., K]; labels: [...].
        lean_scores: compute the terms with :func:`~liger_dspine.ops.refinement_loss.liger_refinement_loss`
            (the fused objective's path): the same numbers in two kernel launches each way, keeping no
            [..., K, H] copy of the head rows.

    Returns:
        ref: [...] fp32, ce_weight * refCE + (1 - ce_weight) * refL1 (refL1 only where the teacher mass on the
            candidates exceeds ``mass_threshold``; refCE is 0 when the label is not a candidate).
        covered: [...] bool, label among the candidates.
    """
    if lean_scores:
        from liger_dspine.ops.refinement_loss import liger_refinement_loss

        return liger_refinement_loss(
            refined, head_weight, candidate_ids, candidate_teacher_probs, labels, ce_weight, mass_threshold
        )
    candidates = head_weight[candidate_ids].float()  # [..., K, H]
    scores = torch.matmul(candidates, refined.float()[..., None]).squeeze(-1)  # [..., K]
    log_probs = torch.log_softmax(scores, dim=-1)
    mass = candidate_teacher_probs.sum(dim=-1, keepdim=True)
    teacher = candidate_teacher_probs / mass.clamp_min(1e-30)
    hits = candidate_ids == labels[..., None]
    ref_ce = -(log_probs * hits).sum(dim=-1)
    ref_l1 = (log_probs.exp() - teacher).abs().sum(dim=-1) * (mass.squeeze(-1) > mass_threshold)
    return ce_weight * ref_ce + (1.0 - ce_weight) * ref_l1, hits.any(dim=-1)


def alignment_terms(layer_features: torch.Tensor, label_codes: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """1 - cos(feature, code) per layer: layer_features [M, L, P, r], label_codes [M, P, r] -> [M, L, P] fp32.

    ``fused`` (the fused objective's path) computes it with
    :func:`~liger_dspine.ops.alignment_cosine.liger_alignment_cosine`: one kernel launch each way.
    """
    if fused:
        from liger_dspine.ops.alignment_cosine import liger_alignment_cosine

        return liger_alignment_cosine(layer_features, label_codes, eps=1e-8)
    return 1.0 - F.cosine_similarity(layer_features.float(), label_codes.float()[:, None], dim=-1, eps=1e-8)


def _check_target_head(draft_model, lm_head, embed_tokens, mask_token_id) -> None:
    """The target's head and embedding against the drafter's vocabulary and width, whether or not the drafter's
    transfer space is ready (a loaded drafter keeps the one its target gave it)."""
    vocab, hidden = draft_model.config.vocab_size, draft_model.config.hidden_size
    for name, module in (("target_lm_head", lm_head), ("target_embed_tokens", embed_tokens)):
        shape = tuple(module.weight.shape)
        if shape != (vocab, hidden):
            raise ValueError(
                f"liger-dspine: DSpine {name} weight is {list(shape)}, but the drafter was built for a target with "
                f"vocabulary {vocab} and hidden size {hidden} ([{vocab}, {hidden}])"
            )
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab:
        raise ValueError(
            f"liger-dspine: DSpine mask_token_id must be a token id in [0, {vocab}), got {mask_token_id!r}"
        )


class DSpineObjective(nn.Module):
    """Trains a :class:`DSpineDraftModel` against a frozen target (its embedding, lm_head and hidden states).

    Args:
        draft_model: the drafter; its transfer space is initialised from ``target_lm_head`` if not ready.
        target_lm_head: nn.Linear [V, H] without bias (frozen here).
        target_embed_tokens: nn.Embedding [V, H] (frozen here).
        mask_token_id: id filling proposal slots; defaults to the draft config's.
        block_size: must equal the draft's when given.
        num_anchors: blocks drawn per row at most.
        loss_decay_gamma: position decay of proposal weights (None -> 7.0; <= 0 disables).
        objective_chunk_blocks: blocks per objective chunk (0 = one chunk, no checkpointing). The eager path
            computes everything chunk by chunk under activation checkpointing; the fused path only the refinement
            and alignment terms (the frozen-head terms are chunked inside their kernel).
        fused_objective: True computes the backbone CE, L1 and top-k candidates with the fused kernel
            (:func:`~liger_dspine.ops.frozen_head_loss.liger_frozen_head_loss`), False with the eager
            :func:`frozen_head_terms`; None (the default) follows ``apply_liger_kernel_to_dspine``: eager unless
            the class or this objective was patched with ``fused_objective=True``.
        head_chunk_rows: rows per chunk of the fused kernel; None fits each chunk's draft and teacher logits in
            640 MiB (1024 rows at a 151936-token vocabulary in bf16). Results do not depend on it.
    """

    def __init__(
        self,
        draft_model: nn.Module,
        target_lm_head: nn.Linear,
        target_embed_tokens: nn.Embedding,
        mask_token_id: int | None = None,
        block_size: int | None = None,
        num_anchors: int = 512,
        loss_decay_gamma: float | None = None,
        objective_chunk_blocks: int = 128,
        fused_objective: bool | None = None,
        head_chunk_rows: int | None = None,
    ):
        super().__init__()
        if block_size is not None and block_size != draft_model.block_size:
            raise ValueError(
                f"DSpine training block_size {block_size} differs from the draft's {draft_model.block_size}"
            )
        if objective_chunk_blocks < 0:
            raise ValueError(f"DSpine objective_chunk_blocks must be >= 0, got {objective_chunk_blocks}")
        if fused_objective not in (None, True, False):
            raise ValueError(f"DSpine fused_objective must be True, False or None, got {fused_objective!r}")
        if head_chunk_rows is not None and head_chunk_rows < 1:
            raise ValueError(f"DSpine head_chunk_rows must be >= 1 or None, got {head_chunk_rows}")
        if target_lm_head.bias is not None:
            raise ValueError("DSpine expects a target lm_head without bias")
        mask_token_id = draft_model.mask_token_id if mask_token_id is None else mask_token_id
        if mask_token_id is None:
            raise ValueError("DSpine needs a mask_token_id (argument or dflash_config.mask_token_id)")
        _check_target_head(draft_model, target_lm_head, target_embed_tokens, mask_token_id)
        if isinstance(num_anchors, bool) or not isinstance(num_anchors, int) or num_anchors < 1:
            raise ValueError(f"DSpine num_anchors must be an int >= 1, got {num_anchors!r}")
        self.draft_model = draft_model
        self.lm_head = target_lm_head.requires_grad_(False)
        self.embed_tokens = target_embed_tokens.requires_grad_(False)
        self.mask_token_id = mask_token_id
        self.block_size = draft_model.block_size
        self.num_anchors = num_anchors
        self.loss_decay_gamma = DEFAULT_LOSS_DECAY_GAMMA if loss_decay_gamma is None else loss_decay_gamma
        self.objective_chunk_blocks = objective_chunk_blocks
        self.dspine_config = draft_model.dspine_config
        self.explicit_fused_objective = fused_objective
        self.head_chunk_rows = head_chunk_rows
        if not bool(draft_model.transfer_ready):
            draft_model.initialize_transfer_space(self.lm_head.weight)

    def _check_inputs(self, input_ids, hidden_states, loss_mask, target_last_hidden_states) -> None:
        """Shapes against each other and the models, and token ids against the vocabulary: a ValueError naming the
        input, before any kernel or embedding reads them (one host synchronisation, next to the anchor count's)."""
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(
                f"liger-dspine: DSpine input_ids must be [B, S] integer token ids, got {tuple(input_ids.shape)} "
                f"{input_ids.dtype}"
            )
        batch, seq = input_ids.shape
        taps = self.draft_model.fc.in_features
        expected = {
            "hidden_states": ((batch, seq, taps), hidden_states),
            "loss_mask": ((batch, seq), loss_mask),
            "target_last_hidden_states": ((batch, seq, self.lm_head.weight.shape[1]), target_last_hidden_states),
        }
        for name, (shape, tensor) in expected.items():
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(
                    f"liger-dspine: DSpine {name} must be {list(shape)} for input_ids {[batch, seq]} (hidden_states: "
                    f"the {len(self.draft_model.target_layer_ids)} target layers' states concatenated), got "
                    f"{list(tensor.shape)}"
                )
        vocab = self.lm_head.weight.shape[0]
        if input_ids.numel():
            low, high = torch.stack(input_ids.aminmax()).tolist()
            if low < 0 or high >= vocab:
                bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
                raise ValueError(
                    f"liger-dspine: DSpine input_ids must be token ids in [0, {vocab}) (the target's vocabulary); "
                    f"{bad.numel()} are outside, from {bad.min().item()} to {bad.max().item()}"
                )

    def patched_fused_objective(self) -> bool:
        """The patch's choice; ``apply_liger_kernel_to_dspine(fused_objective=True)`` replaces this method."""
        return False

    @property
    def fused_objective(self) -> bool:
        """Whether the frozen-head terms run fused: the constructor's True or False, else the patch's choice."""
        explicit = self.explicit_fused_objective
        return self.patched_fused_objective() if explicit is None else explicit

    @fused_objective.setter
    def fused_objective(self, value: bool | None) -> None:
        if value not in (None, True, False):
            raise ValueError(f"DSpine fused_objective must be True, False or None, got {value!r}")
        self.explicit_fused_objective = value

    # ---------------------------------------------------------------------------------------------- chunk functions
    def _ce_terms(self, hidden, labels, weights, supervised):
        """CE-only chunk: (sum CE * w, correct count)."""
        rows, proposals = labels.shape
        terms = frozen_head_terms(hidden.reshape(rows * proposals, -1), self.lm_head.weight, labels.reshape(-1))
        ce = terms.ce.view(rows, proposals)
        correct = (terms.correct.view(rows, proposals) & supervised).sum().float()
        return (ce * weights).sum(), correct

    def _objective_terms(self, hidden, pre, features, labels, previous, teacher, weights, supervised):
        """Full eager chunk: (sum CE w, sum L1 w, sum ref w, sum align w, correct, coverage).

        Shapes: hidden/pre/teacher [c, P, H], features [c, L, P, r], labels/previous/weights/supervised [c, P].
        """
        rows, proposals = labels.shape
        terms = frozen_head_terms(
            hidden.reshape(rows * proposals, -1),
            self.lm_head.weight,
            labels.reshape(-1),
            teacher.reshape(rows * proposals, -1),
            self.dspine_config.top_k,
        )
        ce = terms.ce.view(rows, proposals)
        l1 = terms.l1.view(rows, proposals)
        ref, align, coverage = self._candidate_terms(
            pre,
            features,
            labels,
            previous,
            terms.candidate_ids.view(rows, proposals, -1),
            terms.candidate_teacher_probs.view(rows, proposals, -1),
            weights,
            supervised,
        )
        with torch.no_grad():
            correct = (terms.correct.view(rows, proposals) & supervised).sum().float()
        return (ce * weights).sum(), (l1 * weights).sum(), ref, align, correct, coverage

    def _candidate_terms(self, pre, features, labels, previous, candidate_ids, candidate_probs, weights, supervised):
        """Refinement and alignment of a chunk: (sum ref w, sum align w, coverage); candidates [c, P, K]."""
        options = self.dspine_config
        refined = self.draft_model.refine(pre, previous)
        ref, covered = refinement_terms(
            refined,
            candidate_ids,
            candidate_probs,
            labels,
            self.lm_head.weight,
            options.ce_weight,
            options.candidate_mass_threshold,
            lean_scores=self.fused_objective,
        )
        align = alignment_terms(features, self.draft_model.transfer_codes[labels], fused=self.fused_objective)
        with torch.no_grad():
            coverage = (covered & supervised).sum().float()
        return (ref * weights).sum(), (align * weights[:, None, :]).sum(), coverage

    def _fused_head_loss(self, hidden, labels, weights, teacher=None):
        """The backbone terms of every row through the fused kernel (chunked inside it, never checkpointed).

        Returns ``FrozenHeadLoss``: loss = sum w (ce_weight CE + (1 - ce_weight) L1), or sum w CE without a
        teacher, differentiable in ``hidden``; per-row terms detached.
        """
        from liger_dspine.ops.frozen_head_loss import liger_frozen_head_loss

        rows, proposals = labels.shape
        flat_weights = weights.reshape(-1)
        ce_weight = self.dspine_config.ce_weight
        if teacher is None:
            ce_scale, l1_scale, teacher_rows = flat_weights, None, None
        else:
            ce_scale, l1_scale = ce_weight * flat_weights, (1.0 - ce_weight) * flat_weights
            teacher_rows = teacher.reshape(rows * proposals, -1)
        return liger_frozen_head_loss(
            hidden.reshape(rows * proposals, -1),
            self.lm_head.weight,
            labels.reshape(-1),
            ce_scale,
            teacher_rows,
            l1_scale,
            self.dspine_config.top_k if teacher is not None else 0,
            chunk_rows=self.head_chunk_rows,
        )

    def block_terms(self, hidden, pre, features, labels, previous, teacher, weights, supervised):
        """Every term of the full objective from the drafter's outputs, summed over the proposals.

        Shapes: hidden/pre/teacher [M, P, H], features [M, L, P, r], labels/previous/weights/supervised [M, P].

        Returns:
            (backbone, ce, l1, ref, align, correct, coverage): backbone = sum w (ce_weight CE + (1 - ce_weight) L1)
            and the weighted sums ref and align carry gradients; ce and l1 are the weighted sums (detached on the
            fused path), correct and coverage counts.
        """
        options = self.dspine_config
        rows, proposals = labels.shape
        if self.fused_objective:
            head = self._fused_head_loss(hidden, labels, weights, teacher)
            backbone = head.loss
            ce = (head.terms.ce.view(rows, proposals) * weights).sum()
            l1 = (head.terms.l1.view(rows, proposals) * weights).sum()
            correct = (head.terms.correct.view(rows, proposals) & supervised).sum().float()
            ref, align, coverage = checkpointed_chunk_reduce(
                self._candidate_terms,
                (
                    pre,
                    features,
                    labels,
                    previous,
                    head.terms.candidate_ids.view(rows, proposals, -1),
                    head.terms.candidate_teacher_probs.view(rows, proposals, -1),
                    weights,
                    supervised,
                ),
                self.objective_chunk_blocks,
            )
        else:
            ce, l1, ref, align, correct, coverage = checkpointed_chunk_reduce(
                self._objective_terms,
                (hidden, pre, features, labels, previous, teacher, weights, supervised),
                self.objective_chunk_blocks,
            )
            backbone = options.ce_weight * ce + (1.0 - options.ce_weight) * l1
        return backbone, ce, l1, ref, align, correct, coverage

    def _output_without_anchors(self, device, ce_only: bool, alignment_ce) -> DSpineObjectiveOutput:
        """A batch without anchors: zero terms, and (with autograd) a zero numerator through every trainable
        parameter, whose gradients are exactly 0. No random draw, so the micro-batches after it draw as without it."""
        zero = torch.zeros((), dtype=torch.float32, device=device)
        if ce_only:
            return DSpineObjectiveOutput(zero, zero, {BACKBONE_CE: (zero, zero)}, zero, (zero, zero))
        if alignment_ce is None:  # the other ranks' objectives all-reduce here: take part
            alignment_ce = global_mean_ce(zero, zero)
        alignment_ce = torch.as_tensor(alignment_ce, dtype=torch.float32, device=device).detach()
        trainable = [p for p in self.parameters() if p.requires_grad]
        numerator = sum((p.sum().float() * 0.0 for p in trainable), zero) if torch.is_grad_enabled() else zero
        names = (BACKBONE_CE, "dspine/backbone_l1", "dspine/refinement_loss", "dspine/alignment_loss")
        metrics = {name: (zero, zero) for name in names}
        metrics["dspine/candidate_coverage"] = (zero, zero)
        return DSpineObjectiveOutput(numerator, zero, metrics, zero, (numerator, zero), alignment_ce)

    # ------------------------------------------------------------------------------------------------------ forward
    def _attention_masks(self, anchors, keep, context_length, document_ids=None):
        return draft_attention_masks(self.draft_model.config, anchors, keep, context_length, document_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None = None,
        max_valid_anchors: int | None = None,
        global_step: int = 0,
        total_steps: int | None = None,
        alignment_ce: torch.Tensor | float | None = None,
        ce_only: bool = False,
        document_ids: torch.Tensor | None = None,
    ) -> DSpineObjectiveOutput:
        """
        Args:
            input_ids: [B, S] long.
            hidden_states: [B, S, T*H] target taps (concatenated in ``target_layer_ids`` order).
            loss_mask: [B, S], > 0.5 where supervised.
            target_last_hidden_states: [B, S, H] what the target's head reads (position s predicts s+1): its
                final-normed states, scaled as the target scales its logits (``TargetCapture`` returns them). Not
                needed when ``ce_only``.
            max_valid_anchors: the largest count of valid anchors in a row (computed here when None: a device
                sync); 0 makes the batch contribute nothing (see the module docstring).
            global_step / total_steps: drive the alignment and teacher-forcing schedules.
            alignment_ce: CE_global for the alignment scale; None computes it here (one all-reduce when
                torch.distributed is initialised).
            ce_only: graph-free prepass (autograd must be off): same draws and draft forward, backbone CE only.
            document_ids: [B, S] long, the document of each token of a packed row (``TargetCapture`` returns it
                for ``position_ids``). Anchors then need their next token in their document, a block's proposals
                stop at the document's end, and the draft sees only its document's context.
        """
        if ce_only and torch.is_grad_enabled():
            raise ValueError("DSpine CE prepass requires gradients to be disabled")
        if not ce_only and target_last_hidden_states is None:
            raise ValueError("DSpine objective needs target_last_hidden_states")
        draft = self.draft_model
        self._check_inputs(input_ids, hidden_states, loss_mask, target_last_hidden_states)
        batch, seq = input_ids.shape
        block = self.block_size
        if document_ids is not None and tuple(document_ids.shape) != (batch, seq):
            raise ValueError(
                f"liger-dspine: document_ids must be [B, S] = {(batch, seq)}, got {tuple(document_ids.shape)}"
            )
        if max_valid_anchors is None:
            max_valid_anchors = max_valid_anchor_count(loss_mask, document_ids)
        if max_valid_anchors == 0:
            return self._output_without_anchors(loss_mask.device, ce_only, alignment_ce)
        anchors, keep = sample_anchor_positions(loss_mask, self.num_anchors, max_valid_anchors, document_ids)
        targets = block_targets(input_ids, loss_mask, anchors, keep, block, self.loss_decay_gamma, document_ids)
        beta, p_replace = self.dspine_config.schedule(global_step, total_steps)
        replace = None
        if self.training and p_replace > 0:
            replace = (torch.rand(anchors.shape, device=anchors.device) < p_replace) & keep
        noise_embedding = self.embed_tokens(noise_token_ids(input_ids, anchors, keep, block, self.mask_token_id))
        kwargs = {}
        if (draft.config._attn_implementation or "sdpa") == "flex_attention":
            kwargs["kernel_options"] = {"BACKEND": "TRITON"}
        out = draft(
            draft_position_ids(anchors, seq, block),
            self._attention_masks(anchors, keep, seq, document_ids),
            noise_embedding,
            hidden_states.detach(),
            targets.labels,
            replace,
            **kwargs,
        )

        num_blocks = anchors.shape[1]
        rows, proposals = batch * num_blocks, block - 1
        hidden = out.hidden_states[:, :, 1:].reshape(rows, proposals, -1)
        labels = targets.labels[..., 1:].reshape(rows, proposals)
        weights = targets.weights.reshape(rows, proposals).to(torch.float32)
        supervised = targets.supervised.reshape(rows, proposals)
        denominator = weights.sum()
        count = supervised.sum().float()

        fused = self.fused_objective
        if ce_only:
            if fused:
                head = self._fused_head_loss(hidden, labels, weights)
                ce = head.loss
                correct = (head.terms.correct.view(rows, proposals) & supervised).sum().float()
            else:
                ce, correct = checkpointed_chunk_reduce(
                    self._ce_terms, (hidden, labels, weights, supervised), self.objective_chunk_blocks
                )
            return DSpineObjectiveOutput(
                loss=ce / denominator.clamp_min(1.0),
                accuracy=correct / count.clamp_min(1.0),
                ratio_metrics={BACKBONE_CE: (ce, denominator)},
                accuracy_denom=count,
                loss_terms=(ce, denominator),
            )

        pre = out.pre_injection[:, :, 1:].reshape(rows, proposals, -1)
        features = (
            out.layer_features[:, :, :, 1:].permute(1, 2, 0, 3, 4).reshape(rows, len(draft.layers), proposals, -1)
        )
        previous = targets.labels[..., :-1].reshape(rows, proposals)
        positions = teacher_positions(targets.source).reshape(batch, -1)  # [B, N*P]
        teacher = target_last_hidden_states.detach().gather(
            1, positions[..., None].expand(-1, -1, target_last_hidden_states.shape[-1])
        )
        teacher = teacher.reshape(rows, proposals, -1)
        backbone, ce, l1, ref, align, correct, coverage = self.block_terms(
            hidden, pre, features, labels, previous, teacher, weights, supervised
        )
        if alignment_ce is None:
            alignment_ce = global_mean_ce(ce.detach(), denominator.detach())
        alignment_ce = torch.as_tensor(alignment_ce, dtype=torch.float32, device=ce.device).detach()
        numerator = backbone + ref + beta * alignment_ce * align
        return DSpineObjectiveOutput(
            loss=numerator / denominator.clamp_min(1.0),
            accuracy=correct / count.clamp_min(1.0),
            ratio_metrics={
                BACKBONE_CE: (ce.detach(), denominator),
                "dspine/backbone_l1": (l1.detach(), denominator),
                "dspine/refinement_loss": (ref.detach(), denominator),
                "dspine/alignment_loss": (align.detach(), denominator),
                "dspine/candidate_coverage": (coverage, count),
            },
            accuracy_denom=count,
            loss_terms=(numerator, denominator),
            alignment_ce=alignment_ce,
        )


def global_mean_ce(ce_sum: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """sum CE / sum D over all ranks (one all-reduce when torch.distributed is initialised); 0 when no rank has a
    supervised proposal (every numerator is then 0, so the alignment scale does not matter)."""
    totals = torch.stack([ce_sum.float(), denominator.float()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return mean_or_zero(totals[0], totals[1])


def mean_or_zero(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """total / count, or 0 where count is 0 (no host sync)."""
    return torch.where(count > 0, total / count.clamp_min(torch.finfo(count.dtype).tiny), torch.zeros_like(total))
