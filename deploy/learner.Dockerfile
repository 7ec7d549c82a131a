# The learner on a GPU node: DeepSpeed (NCCL) + the learner extra. It starts from the rollout's
# base image so one image pull serves both, and so held-out evaluation can use the vLLM engine
# (eval.engine: vllm) as well as transformers. Evaluation of math-tir runs the Python tool in
# bubblewrap like the replicas do.
FROM vllm/vllm-openai:latest
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap util-linux && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY spopp ./spopp
COPY services ./services
# torch comes with the base image; DeepSpeed uses it as it is (AdamW from torch, no compiled ops).
RUN pip install --no-cache-dir --no-deps . && pip install --no-cache-dir 'deepspeed==0.19.8' tensorboard tqdm \
    pyyaml 'transformers>=4.51' tokenizers safetensors 'math-verify==0.9.0' pyarrow fastapi 'uvicorn[standard]' \
    prometheus-client pydantic-settings typer httpx
EXPOSE 8100
ENTRYPOINT ["spopp", "learner", "run"]
