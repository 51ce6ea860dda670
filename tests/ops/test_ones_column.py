"""ops.ones_column: the column of ones the fused layer's backward scatters and gathers a value per choice with, made
once per device and dtype in eager mode (a fill kernel less in every backward on the card), fresh elsewhere."""
import torch

from moe_plugin import ops


def test_a_view_of_one_cached_column_that_grows_as_asked():
    like = torch.randn(3, dtype=torch.bfloat16)
    first = ops.ones_column(like, 5)
    assert first.shape == (5, 1) and first.dtype == torch.bfloat16 and first.is_contiguous()
    assert torch.equal(first, torch.ones(5, 1, dtype=torch.bfloat16))
    again = ops.ones_column(like, 4)
    assert again.data_ptr() == first.data_ptr()                  # no new fill
    longer = ops.ones_column(like, 1000)
    assert longer.shape == (1000, 1) and bool((longer == 1).all())
    assert ops.ones_column(torch.randn(2, dtype=torch.float64), 4).dtype == torch.float64


def test_made_under_inference_mode_it_still_serves_autograd_later():
    with torch.inference_mode():
        ops.ones_column(torch.randn(2, dtype=torch.float16), 7_777)   # a size no other test asks for: made here
    w = torch.randn(7_777, 1, dtype=torch.float16, requires_grad=True)
    (w * ops.ones_column(w.detach(), 7_777)).sum().backward()        # an inference tensor would refuse to be saved
    assert bool((w.grad == 1).all())


def test_fresh_for_fake_tensors_and_compiled_code():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = ops.ones_column(torch.empty(2), 3)
    assert type(fake) is not torch.Tensor
    assert all(type(column) is torch.Tensor for column in ops._ONES.values())   # nothing fake was cached

    @torch.compile(backend="aot_eager", fullgraph=True)
    def scaled(x_T1):
        return x_T1 * ops.ones_column(x_T1, x_T1.shape[0])
    x = torch.randn(6, 1)
    assert torch.equal(scaled(x), x)
