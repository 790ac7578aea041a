"""A prepared, sharded dataset as the loader sees it: the images the prepare step skipped are left out of the
order and reported."""

from __future__ import annotations

from raydiff.data.sharded import ShardedImages

SHAPE = (3, 4, 4)


def test_sharded_images_report_what_the_prepare_step_skipped():
    images = ShardedImages(uri="u", source="s", filesystem=None, files=("a",), counts=(9,), shape=SHAPE,
                           window_shards=1, buffer_bytes=1, skipped=({"index": 3, "where": "x", "reason": "y"},))
    assert images.num_good == 9 and images.usable_indices().tolist() == list(range(9))
    assert images.bad_report() == {"count": 1, "fraction": 0.1, "examples": [{"index": 3, "where": "x",
                                                                              "reason": "y"}]}
