# Rollout replicas, the evaluator and the deployment's one-shot steps (model fetch, prior, init) on
# a GPU node: vLLM (CUDA build) + the agent runtime. Sandboxed tool calls need bubblewrap and
# util-linux (setpriv, prlimit), run as root in the container, and the container needs the rights
# bubblewrap uses: SYS_ADMIN and NET_ADMIN, seccomp and AppArmor unconfined (docker-compose.yml's
# x-sandbox-rights, the pods' securityContext in deploy/k8s/; why: deploy/README.md), not privileged.
FROM vllm/vllm-openai:latest
# build-essential and cmake: ALFWorld's jericho and fast-downward build from source.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap util-linux build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY spopp ./spopp
COPY runtime ./runtime
COPY services ./services
COPY tools ./tools
# The model step (`python3 /app/deploy/fetch_model.py`): huggingface_hub comes with vLLM.
COPY deploy/fetch_model.py ./deploy/fetch_model.py
# vllm comes with the base image; install the rest without replacing its torch.
RUN pip install --no-cache-dir --no-deps . && pip install --no-cache-dir 'transformers>=4.51' tokenizers safetensors \
    'math-verify==0.9.0' pyarrow fastapi 'uvicorn[standard]' prometheus-client click httpx pydantic pyyaml tensorboard \
    'alfworld==0.4.2' 'textworld==1.7.0'
EXPOSE 8200
ENTRYPOINT ["spopp"]
CMD ["rollout", "serve"]
