"""Documents cut into chunks (chunked local attention) against a plain per-token reference."""

import pytest

from hybridsp.layout._documents import Documents, chunked_documents


def _chunk_ids(bounds, chunk):
    """Per token: (its document, its chunk inside the document), computed token by token."""
    ids = []
    for doc, (start, end) in enumerate(zip(bounds, bounds[1:])):
        ids += [(doc, (i - start) // chunk) for i in range(start, end)]
    return ids


@pytest.mark.parametrize("chunk", [1, 3, 8, 40])
def test_chunks_are_cut_from_each_document_start(chunk):
    docs = Documents(3, 40, ((0, 5, 30, 40), (0, 40), (0, 1, 2, 40)), window=7)
    cut = chunked_documents(docs, chunk)
    assert cut.window == 7 and chunked_documents(docs, chunk) is cut  # kept in the batch's memo
    for b in range(3):
        segments = _chunk_ids(cut.row(b), 10**9)  # the cut rows' documents, one id per token
        expected = _chunk_ids(docs.row(b), chunk)
        same = [(segments[i] == segments[i + 1]) == (expected[i] == expected[i + 1]) for i in range(39)]
        assert all(same), (b, cut.row(b))
    assert chunked_documents(Documents(1, 16), 8).rows == ((0, 8, 16),)  # an unpacked row: transformers' chunks
    with pytest.raises(ValueError, match="attention_chunk_size must be a positive number of tokens; got 0"):
        chunked_documents(docs, 0)
