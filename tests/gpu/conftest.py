import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, loaded once for the whole session."""
    from gpu.loader import default_model_path, load_model

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_model(progress=False)
