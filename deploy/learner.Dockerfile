# The learner on a GPU node: torch + DeepSpeed (NCCL) and the learner extra. No vLLM, no
# bubblewrap and no privileged mode: it only trains and writes snapshots; evaluation is the
# evaluator's (the rollout image).
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md ./
COPY spopp ./spopp
COPY runtime ./runtime
COPY services ./services
COPY tools ./tools
# torch comes with the base image; DeepSpeed uses it as it is (AdamW from torch, no compiled ops).
RUN pip install --no-cache-dir --no-deps . && pip install --no-cache-dir 'deepspeed==0.19.8' tensorboard tqdm \
    pyyaml 'transformers>=4.51' safetensors fastapi 'uvicorn[standard]' prometheus-client click httpx pydantic
EXPOSE 8100
ENTRYPOINT ["spopp", "learner", "run"]
