"""Interactive Harmony chat in the terminal (`decode --mode=chat`).

Tokens stream: the compiled decode loop hands each new token to the host through an
ordered `io_callback` (see `Generator(on_token=...)`), where Harmony's stream parser
splits it into channels. The final channel prints as it is generated; analysis and
commentary only with --show_analysis, dimmed on a terminal, marked `[analysis]` in a pipe.
The history is kept across turns (earlier turns' analysis is dropped by render_chat);
/reset clears it, /exit or end of input ends the chat.
"""

from __future__ import annotations

import io
import itertools
import sys

from gpt_oss_train import hosts
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.generate import cache_length
from gpt_oss_train.io import tokenizer as tok_lib


class ReplyPrinter:
    """Prints a reply's text by channel: final plainly; analysis and commentary only when
    asked, dimmed on a terminal (else marked with the channel name)."""

    def __init__(self, out, show_analysis: bool, tty: bool):
        self.out, self.show, self.tty = out, show_analysis, tty
        self.channel = None
        self.printed_final = False
        self.open_dim = False

    def write(self, channel: str | None, delta: str):
        if not delta:
            return
        final = channel in ("final", None)
        if not (final or self.show):
            return
        if channel != self.channel:
            self._close_dim()
            if self.channel is not None:
                self.out.write("\n")
            if not final:
                self.out.write("\x1b[2m" if self.tty else f"[{channel}] ")
                self.open_dim = self.tty
            self.channel = channel
        self.out.write(delta)
        self.out.flush()
        self.printed_final |= final

    def _close_dim(self):
        if self.open_dim:
            self.out.write("\x1b[0m")
            self.open_dim = False

    def end(self):
        self._close_dim()
        self.out.write("\n")
        self.out.flush()


class ReplyStream:
    """Feeds tokens, as they are generated, through Harmony's stream parser to a printer.
    A reply the parser cannot read (an untrained model's) is printed as text at the end."""

    def __init__(self, tokenizer: tok_lib.Tokenizer, out, *, show_analysis: bool, tty: bool):
        self.tok = tokenizer
        self.out, self.show_analysis, self.tty = out, show_analysis, tty
        self.start()

    def start(self):
        self.printer = ReplyPrinter(self.out, self.show_analysis, self.tty)
        self.parser = self.tok.stream_parser()
        self.tokens: list[int] = []
        self.broken = False

    def feed(self, token: int):
        self.tokens.append(token)
        if self.broken:
            return
        try:
            self.printer.write(*self.parser.process(token))
        except tok_lib.HarmonyError:
            self.broken = True  # keep collecting; finish() prints what the parser could not

    def on_token(self, tokens, live):
        """Generator callback: row 0's token of this step, if the row is still generating."""
        if bool(live[0]):
            self.feed(int(tokens[0]))

    def finish(self) -> list[dict]:
        messages = None
        if not self.broken:
            try:
                messages = self.parser.finish()
            except tok_lib.HarmonyError:
                pass
        if messages is None:
            messages = self.tok.parse_completion(self.tokens)
        if not self.printer.printed_final:
            # Header-less text is only known to be content at the end; show whatever there is.
            finals = [m["content"] for m in messages if m["channel"] in ("final", None)]
            self.printer.write(None, "".join(finals) or self.tok.decode(self.tokens))
        self.printer.end()
        return messages


def run_chat(model, opts, stdin=None, stdout=None, link: hosts.Link | None = None) -> int:
    """The chat loop over a loaded model (loading.LoadedModel) and loading.Options. On
    several processes (`link`), process 0 reads each line and sends it to the others,
    every process generates the reply, and process 0 prints it once it is whole (a token
    stream from inside the compiled loop is one process's: io_callback)."""
    link = link or hosts.Link(0, 1, {})
    stdin = stdin or sys.stdin
    stdout = (stdout or sys.stdout) if link.leader else io.StringIO()
    interactive = link.leader and stdin.isatty()
    tok = tok_lib.Tokenizer()
    limit = loading.cache_limit(model.cfg.max_position_embeddings, opts)
    stream = ReplyStream(tok, stdout, show_analysis=opts.show_analysis, tty=stdout.isatty())
    on_token = None if link.multihost else stream.on_token
    gen = model.generator(opts.prefill_chunk, opts.int8_kv_cache, on_token=on_token)
    history: list[dict] = []
    if interactive:
        stdout.write("Chat with the model. /reset clears the conversation, /exit ends it.\n")
    for turn in itertools.count():
        if interactive:
            stdout.write("you> ")
            stdout.flush()
        line = link.share(stdin.readline().encode() if link.leader else None).decode()
        if not line:
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            history.clear()
            stdout.write("(conversation cleared)\n")
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        prompt = tok.render_chat(history, opts.reasoning_effort)
        if len(prompt) + 1 > limit:
            history.pop()
            stdout.write(
                f"(the conversation is {len(prompt)} tokens; the cache holds {limit}. "
                "/reset to start over)\n"
            )
            continue
        max_len = min(cache_length(len(prompt) + opts.max_new_tokens), limit)
        stdout.write("assistant> ")
        stdout.flush()
        stream.start()
        with model.scope():
            out = gen.generate(
                [prompt],
                max_new_tokens=opts.max_new_tokens,
                stop_ids=loading.stop_slots(tok.stop_ids),
                sampling=opts.sampling,
                seeds=[(opts.seed + turn) % 2**32],
                max_len=max_len,
            )[0]
        if on_token is None:  # printed whole, now
            for token in out["tokens"]:
                stream.feed(token)
        messages = stream.finish()
        if out["stop_reason"] == "length":
            stdout.write(f"(reply cut at {len(out['tokens'])} tokens)\n")
        # Only the assistant's own messages go back into the history (a garbled reply could
        # parse as some other role, which would make the next prompt invalid).
        replies = [
            {k: v for k, v in m.items() if v is not None}
            for m in messages
            if m["role"] == "assistant"
        ]
        history.extend(
            replies
            or [
                {
                    "role": "assistant",
                    "content": loading.completion_text(out["tokens"], stop_reason="stop") or "",
                }
            ]
        )
    return 0
