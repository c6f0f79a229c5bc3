"""verifier/model/row_tiles.py: row-wise ops in fixed tiles of rows (CUDA's rule for row-invariant
bits; tests/gpu checks the bits on a GPU). Here: what each call sees and what comes back."""
import torch

from verifier.model.row_tiles import TILE_ROWS, in_row_tiles


def test_every_call_sees_exactly_the_tile_size_and_rows_come_back_in_order():
    seen = []

    def fn(rows):
        seen.append(tuple(rows.shape))
        return rows * 2 + 1

    for m in (1, 5, TILE_ROWS, TILE_ROWS + 3, 3 * TILE_ROWS):
        seen.clear()
        x = torch.randn(m, 7)
        out = in_row_tiles(fn, x)
        assert torch.equal(out, x * 2 + 1)
        assert seen == [(TILE_ROWS, 7)] * -(-m // TILE_ROWS)


def test_padding_rows_are_zeros_and_one_row_tiles_take_rows_alone():
    x = torch.arange(6.0).view(3, 2)
    tiles = []
    in_row_tiles(lambda rows: tiles.append(rows.clone()) or rows, x, rows=2)
    assert torch.equal(tiles[1], torch.tensor([[4.0, 5.0], [0.0, 0.0]]))
    alone = in_row_tiles(lambda row: row / row.sum(-1, keepdim=True), x[1:], rows=1)
    assert torch.equal(alone, torch.cat([x[1:2] / x[1].sum(), x[2:3] / x[2].sum()]))
