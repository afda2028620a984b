"""The greedy loop of GenerationRunner on scripted components (no model): stopping, padding after
end-of-sequence, mask and position bookkeeping, cache hand-over, errors."""

from __future__ import annotations

import pytest
import torch

from hfexport.generation import ComponentIO, GenerationPlan, GenerationRunner

VOCAB = 10
EOS, PAD = 2, 0


def _plan(**changes) -> GenerationPlan:
    prompt = {
        "input_ids": torch.zeros(2, 3, dtype=torch.int64),
        "attention_mask": torch.ones(2, 3, dtype=torch.int64),
        "position_ids": torch.zeros(2, 3, dtype=torch.int64),
        "extra": {"scale": torch.ones(2)},
    }
    step = {**prompt, "cache": {"past": torch.zeros(2, 1)}}
    step.pop("extra")
    values = {
        "architecture": "decoder",
        "model_class": "Scripted",
        "components": ["prefill", "decode"],
        "token_ids": {"eos_token_id": [EOS], "pad_token_id": PAD},
        "io": {
            "prefill": ComponentIO.from_kwargs(prompt, ["logits", "cache.past"]),
            "decode": ComponentIO.from_kwargs(step, ["logits", "cache.past"]),
        },
    }
    values.update(changes)
    return GenerationPlan(**values)


class Scripted:
    """Row r emits ``script[r][step]``; records what it was given."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = script
        self.calls: list[dict] = []

    def __call__(self, kwargs):
        self.calls.append(kwargs)
        step = len(self.calls) - 1
        batch = kwargs["input_ids"].shape[0]
        logits = torch.zeros(batch, kwargs["input_ids"].shape[1], VOCAB)
        for row in range(batch):
            logits[row, -1, self.script[row][step]] = 1.0
        return {"logits": logits, "cache.past": torch.full((batch, 1), float(step + 1))}


def _runner(script):
    scripted = Scripted(script)
    # "cache.past" of each decode call is the previous call's output "cache.past"
    plan = _plan()
    runner = GenerationRunner(plan, {"prefill": scripted, "decode": scripted})
    return runner, scripted


def test_rows_finished_by_eos_get_padding_and_the_loop_stops_when_all_finish() -> None:
    runner, scripted = _runner([[5, EOS, 7, 7], [6, 6, EOS, 9]])
    ids = torch.tensor([[3, 4, 5], [0, 4, 5]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    out = runner.generate(ids, mask, max_new_tokens=10, extra={"scale": torch.ones(2)})
    assert out.tolist() == [[3, 4, 5, 5, EOS, PAD], [0, 4, 5, 6, 6, EOS]]
    assert len(scripted.calls) == 3 and len(runner.last_logits) == 3
    prefill, first, second = scripted.calls
    # prefill positions follow the mask (padding at 0), as generate computes them
    assert prefill["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]
    assert first["input_ids"].tolist() == [[5], [6]]
    assert first["attention_mask"].tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert first["position_ids"].tolist() == [[3], [2]]
    assert second["position_ids"].tolist() == [[4], [3]]
    assert prefill["extra"]["scale"].tolist() == [1.0, 1.0]
    assert first["cache"]["past"].tolist() == [[1.0], [1.0]]
    assert second["cache"]["past"].tolist() == [[2.0], [2.0]]


def test_max_new_tokens_bounds_the_run() -> None:
    runner, scripted = _runner([[5, 5, 5], [6, 6, 6]])
    out = runner.generate(
        torch.tensor([[3, 4, 5], [3, 4, 5]]), max_new_tokens=2, extra={"scale": torch.ones(2)}
    )
    assert out.shape == (2, 5) and len(scripted.calls) == 2


def test_errors_name_what_is_missing() -> None:
    plan = _plan()
    with pytest.raises(ValueError, match=r"no caller for component\(s\) \['decode'\]"):
        GenerationRunner(plan, {"prefill": Scripted([[1]])})
    runner, _ = _runner([[1], [1]])
    # a ValueError naming the component, the input and both ways to pass it (it was a KeyError whose
    # advice named generate() alone, also for `hfexport generate` users)
    with pytest.raises(
        ValueError, match=r"component 'prefill' takes the input 'extra\.scale', which was not given"
    ) as err:
        runner.generate(torch.tensor([[3, 4, 5], [3, 4, 5]]), max_new_tokens=1)
    assert "keyword argument extra.scale=..." in str(err.value)
    assert "`hfexport generate --inputs FILE.safetensors` as the tensor named 'extra.scale'" in str(err.value)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        runner.generate(torch.tensor([[3]]), max_new_tokens=0)
    with pytest.raises(ValueError, match="must have the shape of input_ids"):
        runner.generate(torch.tensor([[3, 4]]), torch.ones(1, 3), max_new_tokens=1)
    static = _plan(cache_kind="static", max_cache_len=4)
    with pytest.raises(ValueError, match="static cache holds 4 positions but this run needs 5"):
        GenerationRunner(static, {"prefill": Scripted([[1]]), "decode": Scripted([[1]])}).generate(
            torch.tensor([[3, 4, 5]]), max_new_tokens=2
        )
    with pytest.raises(ValueError, match="multi-token decode graph"):
        GenerationRunner(_plan(components=["decode"]), {"decode": Scripted([[1]])})


def test_plan_round_trips_through_json() -> None:
    plan = _plan(cache_kind="static", max_cache_len=8, mrope={"spatial_merge_size": 2, "channels": 4})
    again = GenerationPlan.from_dict(plan.to_dict())
    assert again.to_dict() == plan.to_dict()
    assert again.io["decode"].tensor_paths == ["input_ids", "attention_mask", "position_ids", "cache.past"]
    with pytest.raises(ValueError, match="unknown generation plan field"):
        GenerationPlan.from_dict({**plan.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="cache_kind="):
        _plan(cache_kind="paged")


def test_unknown_input_keys_are_refused_with_the_keys_the_components_take() -> None:
    runner, scripted = _runner([[1], [1]])
    ids = torch.tensor([[3, 4, 5], [3, 4, 5]])
    # it was silently ignored: a misspelt or unused tensor gave tokens as if it had not been passed
    with pytest.raises(
        ValueError,
        match=r"takes the input\(s\) \['pixel_value'\]; the components take: extra, extra\.scale\.",
    ):
        runner.generate(ids, max_new_tokens=1, extra={"scale": torch.ones(2)}, pixel_value=torch.ones(2, 3))
    assert scripted.calls == []  # refused before any component ran
    # the nested input by its leaf path (what a safetensors file of `hfexport generate --inputs` holds)
    out = runner.generate(ids, max_new_tokens=1, **{"extra.scale": torch.ones(2)})
    assert out.shape == (2, 4) and scripted.calls[0]["extra"]["scale"].tolist() == [1.0, 1.0]


class Guarded(Scripted):
    """A decode step captured with a cache of at least 2 positions: ``program.module()`` refuses a
    shorter one on its guard (the ``ShapeGuardError`` of an ``ExportedProgram`` caller)."""

    def __call__(self, kwargs):
        from hfexport.generation.runner import shape_guard_error

        if kwargs["input_ids"].shape[1] == 1 and kwargs["attention_mask"].shape[1] < 3:  # a decode step
            raise shape_guard_error(AssertionError("Guard failed: attention_mask.size()[1] >= 3"), kwargs)
        return super().__call__(kwargs)


def _image_input_plan(image_step_inputs: bool = True, **changes) -> GenerationPlan:
    """A language model taking the image as an input of its own (Kosmos-2's prefill: the image
    encoder's output and the prompt's ``image_embeds_position_mask``; BLIP's prompt rewrite)."""
    step = {
        "input_ids": torch.zeros(1, 3, dtype=torch.int64),
        "attention_mask": torch.ones(1, 3, dtype=torch.int64),
        "position_ids": torch.zeros(1, 3, dtype=torch.int64),
    }
    prefill = {**step, "image_embeds": torch.zeros(1, 2, 4), "image_embeds_position_mask": torch.zeros(1, 3)}
    if not image_step_inputs:
        prefill = step
    values = {
        "architecture": "multimodal",
        "model_class": "Kosmos2ForConditionalGeneration",
        "components": ["image_encoder", "prefill", "decode"],
        "token_ids": {"eos_token_id": [EOS], "pad_token_id": PAD},
        "links": {"image_encoder": {"pixel_values": {"from": "prompt", "key": "pixel_values"}}},
        "step_inputs": {
            "prefill": {
                "image_embeds": {
                    "from": "component",
                    "component": "image_encoder",
                    "output": "",
                    "drop_first": False,
                },
                "image_embeds_position_mask": {"from": "prompt", "key": "image_embeds_position_mask"},
            },
            "decode": {},
        },
        "io": {
            "image_encoder": ComponentIO.from_kwargs({"pixel_values": torch.zeros(1, 3, 4, 4)}, [""]),
            "prefill": ComponentIO.from_kwargs(prefill, ["logits", "cache.past"]),
            "decode": ComponentIO.from_kwargs(
                {**step, "cache": {"past": torch.zeros(1, 1)}}, ["logits", "cache.past"]
            ),
        },
    }
    values.update(changes)
    return GenerationPlan(**values)


def test_a_missing_step_input_is_a_value_error_naming_the_input_the_step_and_how_to_pass_it() -> None:
    # it was a bare KeyError("the prefill step needs 'image_embeds_position_mask'; pass it to generate()")
    plan = _image_input_plan()
    prefill = Scripted([[5, 6]])
    callers = {
        "image_encoder": lambda kwargs: {"": torch.ones(1, 2, 4)},
        "prefill": prefill,
        "decode": prefill,
    }
    runner = GenerationRunner(plan, callers)
    pixels = torch.zeros(1, 3, 4, 4)
    with pytest.raises(
        ValueError,
        match=r"^the prefill step takes the input 'image_embeds_position_mask', which was not given; ",
    ) as err:
        runner.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=1, pixel_values=pixels)
    assert "keyword argument image_embeds_position_mask=..." in str(err.value)
    assert (
        "`hfexport generate --inputs FILE.safetensors` as the tensor named 'image_embeds_position_mask'"
        in str(err.value)
    )
    out = runner.generate(
        torch.tensor([[3, 4, 5]]),
        max_new_tokens=1,
        pixel_values=pixels,
        image_embeds_position_mask=torch.ones(1, 3),
    )
    assert out.tolist() == [[3, 4, 5, 5]] and prefill.calls[0]["image_embeds"].shape == (1, 2, 4)


def test_a_token_aligned_input_of_another_batch_is_refused_before_any_component_runs() -> None:
    # fresh-user trial: a batch-2 mllama file with a batch-1 prompt failed inside the programs (a guard on
    # the image sides, ExecuTorch error 0x12); pixel_values may count images (LLaVA), so it is not checked
    plan = _image_input_plan()
    prefill = Scripted([[5, 6]])
    image_encoder = Scripted([[0]])
    runner = GenerationRunner(plan, {"image_encoder": image_encoder, "prefill": prefill, "decode": prefill})
    with pytest.raises(
        ValueError,
        match=r"^the prompt has batch 1 \(dim 0 of input_ids\) but image_embeds_position_mask \[2, 3\] has another "
        r"batch on dim 0; give these inputs for the same prompt \(e\.g\. tensor\[:1\]",
    ):
        runner.generate(
            torch.tensor([[3, 4, 5]]),
            max_new_tokens=1,
            pixel_values=torch.zeros(2, 3, 4, 4),
            image_embeds_position_mask=torch.ones(2, 3),
        )
    assert prefill.calls == [] and image_encoder.calls == []


@pytest.mark.parametrize(
    ("prompt_edit", "short", "shortest", "why"),
    [
        ({}, [3], 2, r"\(the exported steps take 2 positions or more\)"),
        # BLIP: generate() drops the processor's closing [SEP], so [CLS] [SEP] leaves 1 position
        (
            {"drop_last": 1},
            [3, 4],
            3,
            r"\(Kosmos2ForConditionalGeneration.generate\(\) leaves out the last 1 prompt",
        ),
    ],
)
def test_a_prompt_below_the_exported_minimum_names_the_minimum(prompt_edit, short, shortest, why) -> None:
    # the decode step's guard refused it with the program's shape condition alone
    from hfexport.generation.runner import ShapeGuardError

    plan = _image_input_plan(False, prompt_edit=prompt_edit, step_inputs={})
    guarded = Guarded([[5, 6, 7]])
    runner = GenerationRunner(
        plan,
        {"image_encoder": lambda kwargs: {"": torch.ones(1, 2, 4)}, "prefill": guarded, "decode": guarded},
    )
    pixels = torch.zeros(1, 3, 4, 4)
    with pytest.raises(
        ShapeGuardError,
        match=rf"^the prompt has {len(short)} token\(s\); this export takes prompts of at least {shortest} tokens {why}",
    ) as err:
        runner.generate(torch.tensor([short]), max_new_tokens=2, pixel_values=pixels)
    assert isinstance(err.value, ValueError) and "Guard failed: attention_mask.size()[1] >= 3" in str(
        err.value
    )
    longer = torch.tensor([[3, 4, 5, 6][:shortest]])
    out = runner.generate(longer, max_new_tokens=1, pixel_values=pixels)
    kept = shortest - prompt_edit.get("drop_last", 0)  # the prompt as the runner returns it (rewritten)
    assert out.shape == (1, kept + 1)
    if prompt_edit:  # a prompt the rewrite would leave empty is refused before any step runs
        with pytest.raises(
            ValueError,
            match=r"leaves out the last 1 prompt token\(s\); the prompt has 1: .* of at least 3 tokens",
        ):
            runner.generate(torch.tensor([[3]]), max_new_tokens=1, pixel_values=pixels)
