"""The output processor's outputs per step, as vLLM's engine API gives them."""

from transformers import AutoTokenizer

from nanoinfer.engine.output_processor import OutputProcessor
from nanoinfer.outputs import EngineCoreOutput
from nanoinfer.sampling_params import RequestOutputKind
from nanoinfer.sampling_params import SamplingParams


def test_delta_outputs_of_n_children_give_only_what_is_new(smollm2_path):
    """DELTA with n=2: an output holds only the children with something new, as vLLM's do. Once a child's output
    carried its finish_reason, later outputs leave that child out (they repeated it, empty, with its finish_reason:
    a client counting finishes saw it twice), and a child that did not step (preempted, waiting) is left out too."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode(" a b c d", add_special_tokens=False)
    processor.add_request("r", None, [1], SamplingParams(n=2, max_tokens=4), ["r@0", "r@1"], RequestOutputKind.DELTA)
    steps = [[EngineCoreOutput("r@0", ids[:1]), EngineCoreOutput("r@1", ids[:1])],
             [EngineCoreOutput("r@0", ids[1:2], finish_reason="length"), EngineCoreOutput("r@1", ids[1:2])],
             [EngineCoreOutput("r@1", ids[2:3])],
             [EngineCoreOutput("r@1", ids[3:4], finish_reason="length")]]
    processor.add_request("s", None, [1], SamplingParams(n=2, max_tokens=4), ["s@0", "s@1"], RequestOutputKind.DELTA)
    steps[2].append(EngineCoreOutput("s@0", ids[:1]))
    seen = []
    for step in steps:
        output, *others = processor.process_outputs(step)[0]
        seen.append([(c.index, c.text, c.finish_reason) for c in output.outputs])
        assert [[(c.index, c.text) for c in o.outputs] for o in others] == ([[(0, " a")]] if len(seen) == 3 else [])
    assert seen == [[(0, " a", None), (1, " a", None)], [(0, " b", "length"), (1, " b", None)],
                    [(1, " c", None)], [(1, " d", "length")]]
    assert output.finished and list(processor.parents) == ["s"]
    assert processor.process_outputs([EngineCoreOutput("s@1", [])])[0] == []  # nothing new: no output at all


def test_folded_deltas_keep_the_running_logprob_sum_and_the_order():
    """A slow reader's deltas, folded into one (OutputStream): the later cumulative_logprob is the sum so far,
    and the completions stay in index order whichever came first."""
    from nanoinfer.outputs import CompletionOutput, RequestOutput

    first = RequestOutput("r", None, [1], [CompletionOutput(1, "a", [5], [], None, cumulative_logprob=-1.0)], False)
    first.add(RequestOutput("r", None, [1], [CompletionOutput(0, "x", [7], [], None, cumulative_logprob=-0.5),
                                             CompletionOutput(1, "b", [6], [], "length", cumulative_logprob=-3.0)],
                            False))
    assert [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.finish_reason) for c in first.outputs] == [
        (0, "x", [7], -0.5, None), (1, "ab", [5, 6], -3.0, "length")]
