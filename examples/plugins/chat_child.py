"""The child side of `subprocess_agent`: one model call with nothing but the standard library.

It knows no spopp and no openai package: it reads what every OpenAI-compatible tool reads
(OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL) and POSTs the chat request, as curl would:

    curl -s "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $OPENAI_API_KEY" \
        -H 'Content-Type: application/json' \
        -d "{\"model\": \"$OPENAI_MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"2+3?\"}]}"

Usage: python chat_child.py PROMPT; prints the reply's text.
"""

import json
import os
import sys
import urllib.request


def main(prompt: str) -> None:
    body = {"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": prompt}]}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        print(json.load(reply)["choices"][0]["message"]["content"] or "", end="")


if __name__ == "__main__":
    main(sys.argv[1])
