# The tracker installs without torch or vLLM: only the core and the `tracker` extra.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY spopp ./spopp
COPY runtime ./runtime
COPY services ./services
RUN pip install --no-cache-dir '.[tracker]'
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz')"
CMD ["spopp", "tracker", "serve", "--host", "0.0.0.0", "--port", "8000"]
