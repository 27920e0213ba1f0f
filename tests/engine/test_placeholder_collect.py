def test_engine_env_imports_vllm():
    import vllm

    assert vllm.__version__ == "0.23.0"
