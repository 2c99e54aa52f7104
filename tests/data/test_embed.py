import pytest
import torch

from openk2.data.embed import SentenceEmbedder, default_embedder


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return default_embedder()


def test_vectors_are_unit_norm_and_batch_independent(embedder):
    texts = ["The cat sat on the mat.", "A short one.", "Quantum chromodynamics describes the strong force."]
    together = embedder.encode(texts, batch_size=3)
    one_by_one = embedder.encode(texts, batch_size=1)
    assert together.shape == (3, 384)
    torch.testing.assert_close(together.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=1e-4)  # padding must not leak in


def test_paraphrase_scores_above_unrelated_text(embedder):
    source = ["The Eiffel Tower is a wrought-iron tower in Paris, finished in 1889."] * 2
    other = ["Completed in 1889, the Eiffel Tower is an iron lattice tower located in Paris.",
             "Photosynthesis turns light, water and carbon dioxide into sugar in plant leaves."]
    paraphrase, unrelated = embedder.similarity(source, other).tolist()
    assert paraphrase > 0.8 and unrelated < 0.3, (paraphrase, unrelated)


def test_bad_input_is_a_clear_error(embedder, tmp_path):
    with pytest.raises(ValueError, match="list of strings"):
        embedder.encode("not a list")
    with pytest.raises(ValueError, match="equal length"):
        embedder.similarity(["a"], ["b", "c"])
    with pytest.raises(ValueError, match="does not exist"):
        SentenceEmbedder(tmp_path / "missing")
    assert embedder.encode([]).shape == (0, 384)
