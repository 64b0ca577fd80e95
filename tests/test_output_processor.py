"""The output processor's outputs per step, as vLLM's engine API gives them."""

from transformers import AutoTokenizer

from nanoinfer.engine.output_processor import OutputProcessor
from nanoinfer.outputs import EngineCoreOutput, RequestOutputKind
from nanoinfer.sampling_params import SamplingParams


def test_delta_outputs_of_n_children_give_each_finish_once(smollm2_path):
    """DELTA with n=2: once a child's output carried its finish_reason, later outputs of the request leave that
    child out (they repeated it, empty, with its finish_reason: a client counting finishes saw it twice)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode(" a b c d", add_special_tokens=False)
    processor.add_request("r", None, [1], SamplingParams(n=2, max_tokens=4), ["r@0", "r@1"], RequestOutputKind.DELTA)
    steps = [[EngineCoreOutput("r@0", ids[:1]), EngineCoreOutput("r@1", ids[:1])],
             [EngineCoreOutput("r@0", ids[1:2], finish_reason="length"), EngineCoreOutput("r@1", ids[1:2])],
             [EngineCoreOutput("r@1", ids[2:3])],
             [EngineCoreOutput("r@1", ids[3:4], finish_reason="length")]]
    seen = []
    for step in steps:
        (output,), _ = processor.process_outputs(step)
        seen.append([(c.index, c.text, c.finish_reason) for c in output.outputs])
    assert seen == [[(0, " a", None), (1, " a", None)], [(0, " b", "length"), (1, " b", None)],
                    [(1, " c", None)], [(1, " d", "length")]]
    assert output.finished and not processor.parents
