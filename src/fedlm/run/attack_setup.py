"""The ``attack`` section made real for a prepared run: who attacks, their poisoned rows, the backdoor's test."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from fedlm.config import ExperimentConfig
from fedlm.errors import UserError
from fedlm.federation.attacks import DATA_ATTACKS, Attack, chosen_clients


@dataclass(frozen=True)
class AttackSetup:
    """The attack, the clients' training rows as the attackers among them poisoned them, and the test rows a
    backdoor's success is measured on (empty for other attacks)."""

    attack: Attack
    client_train: dict[int, list[dict]]
    triggered_test: list[dict]


def set_up_attack(config: ExperimentConfig, task_name: str, label_names: list[str] | None,
                  tokenizer: PreTrainedTokenizerBase, client_train: dict[int, list[dict]],
                  test_rows: list[dict]) -> AttackSetup | None:
    """None without an attack. Data attacks need labels to flip or to target: a classification task."""
    section = config.attack
    if section.kind == "none":
        return None
    num_labels = len(label_names or ())
    if section.kind in DATA_ATTACKS:
        if task_name != "classification" or num_labels < 2:
            raise UserError(f"attack.kind {section.kind} poisons class labels, and the task is {task_name}: use it "
                            "on a classification task, or attack the updates (scale, sign_flip, noise)")
        if section.target_label >= num_labels:
            raise UserError(f"attack.target_label = {section.target_label}, but the labels are 0 to "
                            f"{num_labels - 1} ({', '.join(map(str, label_names or ()))})")
    trigger = tuple(tokenizer(section.trigger, add_special_tokens=False)["input_ids"])
    attack = Attack(section.kind, chosen_clients(section.clients, section.fraction, len(client_train), config.seed),
                    scale=section.factor(), noise_std=section.noise_std, trigger_ids=trigger,
                    target_label=section.target_label, poison_share=section.poison_share)
    max_length = config.model.max_length
    poisoned = {cid: attack.poison(cid, rows, num_labels, max_length, config.seed)
                for cid, rows in client_train.items()}
    return AttackSetup(attack, poisoned, attack.triggered_test(test_rows, max_length))
