"""A harness of our own for the tests: the plain ``openai`` client, two model calls, one sandbox command between them.

Run once per attempt with the gateway's connection in its environment (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``TSLIGHTNING_*``). It asks the model, runs ``SCRIPTED_COMMAND`` (default: a command that shows where it runs) in the
attempt's sandbox, sends the conversation back as text with the output appended, and exits. ``SCRIPTED_REWRITE=1``
replaces the history by a summary for the second call (a history rewrite).
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import openai

COMMAND = os.environ.get("SCRIPTED_COMMAND", "pwd; ls /; echo written > /app/harness-was-here.txt")


def run_command(command: str) -> dict:
    request = urllib.request.Request(
        os.environ["TSLIGHTNING_COMMAND_URL"],
        data=json.dumps({"command": command}).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def main() -> None:
    client = openai.OpenAI(max_retries=0)  # base URL and key from the environment, as any OpenAI client
    model = os.environ["TSLIGHTNING_MODEL"]
    task = Path(os.environ["TSLIGHTNING_INSTRUCTION_FILE"]).read_text().strip()
    messages = [{"role": "system", "content": "Solve the task."}, {"role": "user", "content": task}]
    reply = client.chat.completions.create(model=model, messages=messages)
    outcome = run_command(COMMAND)
    print(json.dumps({"command": COMMAND, **outcome}))
    observation = f"exit code {outcome['exit_code']}\n{outcome['output']}"
    if os.environ.get("SCRIPTED_REWRITE"):
        messages = [messages[0], {"role": "user", "content": f"Summary so far: one command ran.\n{observation}"}]
    else:
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": observation}]
    client.chat.completions.create(model=model, messages=messages)


if __name__ == "__main__":
    main()
