// The three chat APIs the playground speaks: each turns one conversation (images included) into its request body and reads
// its stream of events back into the same pieces (text, thinking, tool calls, usage, finish).

// OpenAI tool definitions ({type: "function", function: {...}}) as each API writes them.
function functions(tools) {
  return tools.map((t) => (t.function || t));
}

// A chat message's content as Responses' input parts: plain text stays text; chat's parts (images, then
// text, as the playground writes a user turn) become input_image and input_text parts in the same order.
function responsesContent(content) {
  if (!Array.isArray(content)) return content;
  return content.map((part) => (part.type === "image_url"
    ? { type: "input_image", image_url: part.image_url.url }
    : { type: "input_text", text: part.text }));
}

// The media types Messages takes in a base64 image source; other images (BMP) go as a URL source holding
// the data URL, which this server reads as chat reads an image_url part.
const BASE64_MEDIA = ["image/jpeg", "image/png", "image/gif", "image/webp"];

// A chat message's content as Messages' blocks: plain text stays text; image parts become image blocks.
function messagesContent(content) {
  if (!Array.isArray(content)) return content;
  return content.map((part) => {
    if (part.type !== "image_url") return { type: "text", text: part.text };
    const url = part.image_url.url;
    const inline = /^data:([\w.+-]+\/[\w.+-]+);base64,/.exec(url);
    if (inline && BASE64_MEDIA.includes(inline[1])) {
      return { type: "image", source: { type: "base64", media_type: inline[1], data: url.slice(inline[0].length) } };
    }
    return { type: "image", source: { type: "url", url } };
  });
}

// A request body's conversation, sampling and constraint per API; `chat` is the Chat Completions body
// buildBody made (messages, sampling fields, response_format / guided_*, tools, tool_choice).
export const APIS = {
  chat_completions: {
    path: "/v1/chat/completions",
    body: (chat) => chat,
  },
  responses: {
    path: "/v1/responses",
    body(chat, model) {
      const body = { model, stream: true, store: false };
      const system = chat.messages.filter((m) => m.role === "system").map((m) => m.content).join("\n");
      if (system) body.instructions = system;
      body.input = chat.messages.filter((m) => m.role !== "system")
        .map((m) => ({ role: m.role, content: responsesContent(m.content) }));
      for (const name of ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "guided_regex", "guided_choice"]) {
        if (chat[name] !== undefined) body[name] = chat[name];
      }
      if (chat.max_tokens !== undefined) body.max_output_tokens = chat.max_tokens;
      if (chat.response_format) {
        const format = chat.response_format.json_schema;
        body.text = { format: { type: "json_schema", name: format.name, schema: format.schema } };
      }
      if (chat.tools) {
        body.tools = functions(chat.tools).map((f) => ({ type: "function", ...f }));
        body.tool_choice = chat.tool_choice;
      }
      return body;
    },
  },
  messages: {
    path: "/v1/messages",
    body(chat, model) {
      const body = { model, stream: true, max_tokens: chat.max_tokens || 256 };
      const system = chat.messages.filter((m) => m.role === "system").map((m) => m.content).join("\n");
      if (system) body.system = system;
      body.messages = chat.messages.filter((m) => m.role !== "system")
        .map((m) => ({ role: m.role, content: messagesContent(m.content) }));
      for (const name of ["temperature", "top_p", "seed", "guided_regex", "guided_choice"]) {
        if (chat[name] !== undefined) body[name] = chat[name];
      }
      if (chat.top_k !== undefined && chat.top_k > 0) body.top_k = chat.top_k;
      if (chat.stop) body.stop_sequences = chat.stop;
      if (chat.response_format) body.guided_json = chat.response_format.json_schema.schema;
      if (chat.tools) {
        body.tools = functions(chat.tools).map((f) => ({ name: f.name, description: f.description,
          input_schema: f.parameters || { type: "object" } }));
        body.tool_choice = { auto: { type: "auto" }, none: { type: "none" }, required: { type: "any" } }[chat.tool_choice];
      }
      return body;
    },
  },
};

// What one event of a stream adds: {text, thinking, calls: [OpenAI tool_calls deltas], tokens, finish};
// null for events that add nothing. Throws Error for an error event.
export function readEvent(api, event, data, state) {
  if (api === "responses") return responseEvent(event, JSON.parse(data), state);
  if (api === "messages") return messageEvent(event, JSON.parse(data), state);
  return null;
}

function responseEvent(event, data, state) {
  switch (data.type) {
    case "error":
      throw new Error(data.message || "the response failed");
    case "response.output_text.delta":
      return { text: data.delta };
    case "response.reasoning_text.delta":
      return { thinking: data.delta };
    case "response.output_item.done":
      if (data.item.type !== "function_call") return null;
      state.calls = (state.calls || 0) + 1;
      return { calls: [{ index: state.calls - 1, id: data.item.call_id,
        function: { name: data.item.name, arguments: data.item.arguments } }] };
    case "response.completed":
    case "response.incomplete": {
      const r = data.response;
      return { tokens: r.usage && r.usage.output_tokens,
        finish: r.status === "incomplete" ? "length" : (state.calls ? "tool_calls" : "stop") };
    }
    default:
      return null;
  }
}

function messageEvent(event, data, state) {
  switch (data.type) {
    case "error":
      throw new Error(data.error ? data.error.message : "the message failed");
    case "content_block_start":
      if (data.content_block.type !== "tool_use") return null;
      state.calls = (state.calls || 0) + 1;
      return { calls: [{ index: state.calls - 1, id: data.content_block.id,
        function: { name: data.content_block.name, arguments: "" } }] };
    case "content_block_delta": {
      const d = data.delta;
      if (d.type === "text_delta") return { text: d.text };
      if (d.type === "thinking_delta") return { thinking: d.thinking };
      if (d.type === "input_json_delta") return { calls: [{ index: state.calls - 1, function: { arguments: d.partial_json } }] };
      return null;
    }
    case "message_delta":
      return { tokens: data.usage && data.usage.output_tokens, finish: data.delta.stop_reason };
    default:
      return null;
  }
}
