"""JSON schemas and function tools the structured-output tests hold answers to: every
form the acceptance names (nested objects, arrays with maxItems, enums, booleans, strings
with maxLength, required fields), bounded so a random model's draws end."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "member": {"type": "boolean"},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "floors": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "member", "home"],
    "additionalProperties": False,
}

# function tools as the engine's grammars take them ({"name", "parameters"})
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
SEARCH = {
    "name": "search",
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 20},
            "top": {"type": "integer", "maximum": 9},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}


def chat_tool(tool: dict) -> dict:
    """The tool as chat's `tools` list takes it."""
    return {"type": "function", "function": tool}
