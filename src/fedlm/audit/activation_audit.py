"""The activation-inversion audit of a split run (FL-GLM Table 4): for the run's cut, how much of the clients'
real text an inversion model recovers from the boundary activations, with the client bottom untrained (the
public starting weights, as in the first round) and trained (the run's checkpoint).

The attacker trains its inverter on public text passed through the bottom it knows: the public starting
weights, or the trained bottom itself when the run shares bottoms through the server (client_parts share /
average / average_bottom hand the server the bottom's parameters; local keeps them from it)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedTokenizerBase

from fedlm.audit.boundary import bottom_inputs, boundary_set, client_batches, public_batches
from fedlm.audit.exposure import activation_violations
from fedlm.audit.inversion import BoundarySet, Kind, invert, train_inverter
from fedlm.audit.scores import bleu4, chance_accuracy, decode_rows, token_accuracy
from fedlm.audit.target import AuditTarget
from fedlm.federation.params import load_into
from fedlm.models.cut import SplitModel
from fedlm.split.modes import TrunkChoice
from fedlm.split.parts import split_model

log = logging.getLogger("fedlm")


@dataclass(frozen=True)
class InversionSettings:
    """The attack's budget: public sequences, client sequences attacked, inverter kind and training steps; its
    seed draws the inverter's initialisation, batches and the attacked sequences (None: the run's seed, so a run
    under several seeds is attacked under as many)."""

    public_sequences: int = 2000
    client_sequences: int = 64
    kind: Kind = "transformer"
    steps: int = 300
    seed: int | None = None


def bottom_is_shared(target: AuditTarget, split: SplitModel) -> bool:
    """The server receives the client bottom's trained parameters (so the attacker can use them)."""
    trainable = {n for n, p in split.model.named_parameters() if p.requires_grad}
    bottom = [n for n in split.bottom_parameter_names() if n in trainable]
    return bool(bottom) and set(bottom) <= set(target.policy.global_names)


def activation_audit(target: AuditTarget, public_texts: Sequence[str], client_ids: Sequence[int],
                     settings: InversionSettings) -> dict:
    """Token accuracy and BLEU-4 of the recovered client text, bottom untrained and trained; plus the
    value-level check that no forward message's integer tensor is the token ids."""
    prep, spec = target.prep, target.config.split
    if settings.seed is None:
        settings = replace(settings, seed=target.config.seed)
    torch.manual_seed(settings.seed)  # the dropout draws of the recomputed messages
    wire_dtype = TrunkChoice.of(spec).wire_dtype
    public_split = split_model(prep.model, spec)
    trained_model = copy.deepcopy(prep.model)
    trained_split = split_model(trained_model, spec)
    public = public_batches(prep.tokenizer, public_texts, target.config.model.max_length)
    victims = {cid: client_batches(prep.task, prep.client_train[cid], settings.client_sequences,
                                   target.config.train.batch_size, settings.seed) for cid in client_ids}
    victims = {cid: batches for cid, batches in victims.items() if batches}
    public_set = boundary_set(public_split.bottom, public, wire_dtype)
    log.info("audit: training the %s inverter on %d public sequences (%d steps)", settings.kind, len(public_set),
             settings.steps)
    public_inverter = train_inverter(public_set, kind=settings.kind, steps=settings.steps, seed=settings.seed)

    untrained = {cid: boundary_set(public_split.bottom, batches, wire_dtype) for cid, batches in victims.items()}
    shared = bottom_is_shared(target, trained_split)
    trained: dict[int, BoundarySet] = {}
    for cid, batches in victims.items():
        load_into(trained_model, target.trained(cid))
        trained[cid] = boundary_set(trained_split.bottom, batches, wire_dtype)
    if shared:  # every client's trained bottom is the checkpoint's global one, and the server holds it
        load_into(trained_model, target.global_params())
        trained_inverter = train_inverter(boundary_set(trained_split.bottom, public, wire_dtype),
                                          kind=settings.kind, steps=settings.steps, seed=settings.seed)
    else:
        trained_inverter = public_inverter
    violations = []
    device = next(public_split.bottom.parameters()).device
    with torch.no_grad():
        for batches in victims.values():
            sent = public_split.bottom(**bottom_inputs(batches[0], device))
            violations += activation_violations(sent, batches[0]["input_ids"])
    return {
        "cut": [spec.bottom_blocks, spec.top_blocks],
        "wire_dtype": spec.activation_dtype,
        "inverter": settings.kind, "inverter_steps": settings.steps, "inverter_seed": settings.seed,
        "public_sequences": len(public_set),
        "attacker_knows_trained_bottom": shared,
        "untrained": _score(public_inverter, untrained, public_set, prep.tokenizer),
        "trained": _score(trained_inverter, trained, public_set, prep.tokenizer),
        "violations": violations,
    }


def _score(inverter: torch.nn.Module, targets: dict[int, BoundarySet], public: BoundarySet,
           tokenizer: PreTrainedTokenizerBase) -> dict:
    """Token accuracy, chance accuracy and BLEU-4 over every attacked client, and per client."""
    per_client, hyps, refs = {}, [], []
    guesses, ids, masks = [], [], []
    for cid, target in targets.items():
        guess = invert(inverter, target)
        per_client[str(cid)] = {"sequences": len(target), "token_accuracy": token_accuracy(guess, target.ids,
                                                                                             target.mask)}
        hyps += decode_rows(tokenizer, guess, target.mask)
        refs += decode_rows(tokenizer, target.ids, target.mask)
        guesses.append(guess.flatten())
        ids.append(target.ids.flatten())
        masks.append(target.mask.flatten())
    if not guesses:
        return {"sequences": 0}
    guess, true, mask = torch.cat(guesses), torch.cat(ids), torch.cat(masks)
    return {"sequences": len(hyps), "tokens": int(mask.sum()), "token_accuracy": token_accuracy(guess, true, mask),
            "chance_accuracy": chance_accuracy(public.ids, public.mask, true, mask),
            "bleu4": bleu4(hyps, refs), "clients": per_client}
