"""Writes tests/fixtures/parquet/: small Parquet files as the Hugging Face Hub stores
datasets, in three codecs and three layouts, and one with a bad row (tests/it/formats.rs).

    pip install pyarrow
    python scripts/make_parquet_fixtures.py tests/fixtures/parquet
"""
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
# Our layout, snappy (the Hub's usual codec), two rows a row group.
pq.write_table(
    pa.table({
        "query": ["who made light", "a, \"quoted\" query", "third"],
        "positive": ["God made light", "its passage", "third passage"],
        "negatives": [["the sea", "the land"], [], None],
    }),
    os.path.join(out, "pairs.parquet"), compression="snappy", row_group_size=2,
)
# Tevatron's layout, zstd.
passage = pa.struct([("docid", pa.string()), ("title", pa.string()), ("text", pa.string())])
pq.write_table(
    pa.table({
        "query_id": ["1", "2"],
        "query": ["who made light", "a, \"quoted\" query"],
        "positive_passages": pa.array([
            [{"docid": "7", "title": "God", "text": "made light"}, {"docid": "8", "title": None, "text": "ignored"}],
            [{"docid": "3", "title": None, "text": "its passage"}],
        ], pa.list_(passage)),
        "negative_passages": pa.array([
            [{"docid": "9", "title": "", "text": "the sea"}, {"docid": "10", "title": None, "text": "the land"}],
            [],
        ], pa.list_(passage)),
    }),
    os.path.join(out, "tevatron.parquet"), compression="zstd",
)
# sentence-transformers' columns (anchor / positive / negative_1 / negative_2), gzip.
pq.write_table(
    pa.table({
        "anchor": ["who made light", "a, \"quoted\" query"],
        "positive": ["God made light", "its passage"],
        "negative_2": ["the land", None],
        "negative_1": ["the sea", ""],
    }),
    os.path.join(out, "st-columns.parquet"), compression="gzip",
)
# A bad row: the third row's query is empty, in the second row group.
pq.write_table(
    pa.table({"query": ["a", "b", " "], "positive": ["x", "y", "z"]}),
    os.path.join(out, "bad.parquet"), compression="snappy", row_group_size=2,
)
print(sorted(os.listdir(out)))
