// sdmha/io/detail/keras_config.hpp — what config.json of a .keras file says about its layers:
// the layer tree walked as Keras' saving_lib walks the model (which gives every layer its HDF5
// group), and a MultiHeadAttention's configuration (num_heads, key_dim, value_dim, use_bias,
// output_shape, the build shapes), checked against what sdmha implements and against the
// MhaConfig a caller gives.
#pragma once

#include <cctype>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"
#include "sdmha/io/detail/hdf5.hpp"
#include "sdmha/io/detail/keras_archive.hpp"
#include "sdmha/weights.hpp"

namespace sdmha::detail::keras {

constexpr int kMaxModelNesting = 32;  // models within models in config.json

// Keras' naming.to_snake_case: drop non-word characters, '_' before a capital that starts a
// lower-case run and between a lower-case letter and a capital, then lower-case.
inline std::string to_snake_case(const std::string& name) {
  std::string word;
  for (const char c : name)
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
        static_cast<unsigned char>(c) >= 0x80)
      word += c;
  auto upper = [&](std::size_t i) {
    return i < word.size() && std::isupper((unsigned char)word[i]);
  };
  auto lower = [&](std::size_t i) {
    return i < word.size() && std::islower((unsigned char)word[i]);
  };
  std::string first;  // re.sub("(.)([A-Z][a-z]+)", r"\1_\2", ...): non-overlapping, left to right
  for (std::size_t i = 0; i < word.size();) {
    if (upper(i + 1) && lower(i + 2)) {
      std::size_t end = i + 2;
      while (lower(end)) ++end;
      first += word.substr(i, 1) + "_" + word.substr(i + 1, end - i - 1);
      i = end;
    } else {
      first += word[i++];
    }
  }
  word.swap(first);
  std::string second;  // re.sub("([a-z])([A-Z])", r"\1_\2", ...)
  for (std::size_t i = 0; i < word.size();) {
    if (lower(i) && upper(i + 1)) {
      second += word.substr(i, 1) + "_" + word.substr(i + 1, 1);
      i += 2;
    } else {
      second += word[i++];
    }
  }
  for (char& c : second) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return second;
}

// A layer entry of config.json with the HDF5 group that saving_lib gives it.
struct ConfigLayer {
  std::string name;
  std::string class_name;
  std::string group;
  std::string location;  // where in config.json, for messages
  const json* entry = nullptr;
};

inline const json* member(const json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  const auto found = object.find(key);
  return found == object.end() || found->is_null() ? nullptr : &*found;
}

inline std::string entry_name(const json& entry) {
  const json* config = member(entry, "config");
  const json* name = config ? member(*config, "name") : nullptr;
  if (!name) name = member(entry, "name");
  return name && name->is_string() ? name->get<std::string>() : std::string();
}

// Walks a serialized object as saving_lib walks the model: the `layers` of a Functional or
// Sequential model (any config with a "layers" list) go to `<group>/layers/<class>[_n]`.
inline void collect_layers(const KerasFile& file, const json& entry, const std::string& group,
                           const std::string& location, int depth, std::vector<ConfigLayer>& out) {
  const json* class_name = member(entry, "class_name");
  if (!class_name || !class_name->is_string())
    fail<FormatError>(kWhere, "'", file.config_name, "': ", location,
                      " has no string 'class_name'; expected a serialized Keras object");
  out.push_back({entry_name(entry), class_name->get<std::string>(), group, location, &entry});
  const json* config = member(entry, "config");
  const json* layers = config ? member(*config, "layers") : nullptr;
  if (!layers || !layers->is_array() || out.back().class_name == "MultiHeadAttention") return;
  if (depth >= kMaxModelNesting)
    fail<FormatError>(kWhere, "'", file.config_name, "': ", location, " nests models more than ",
                      kMaxModelNesting, " deep");
  std::map<std::string, int> used;  // saving_lib._get_unique_name
  for (std::size_t i = 0; i < layers->size(); ++i) {
    const json& child = (*layers)[i];
    const json* child_class = member(child, "class_name");
    const std::string child_location = location + ".config.layers[" + std::to_string(i) + "]";
    if (!child_class || !child_class->is_string())
      fail<FormatError>(kWhere, "'", file.config_name, "': ", child_location,
                        " has no string 'class_name'; expected a serialized Keras layer");
    const std::string snake = to_snake_case(child_class->get<std::string>());
    const auto [it, first] = used.emplace(snake, 0);
    const std::string unique = first ? snake : snake + "_" + std::to_string(++it->second);
    collect_layers(file, child, join_path(group, "layers/" + unique), child_location, depth + 1,
                   out);
  }
}

inline std::vector<ConfigLayer> config_layers(const KerasFile& file) {
  std::vector<ConfigLayer> layers;
  if (file.config) collect_layers(file, *file.config, "", "config.json", 0, layers);
  return layers;
}

// ---- The configuration --------------------------------------------------------------------------

// What the configuration fixes; nothing = whatever the datasets say.
struct Expected {
  std::optional<std::int64_t> heads, key_dim, value_dim, output_dim;  // output_dim 0 = Eq
  std::optional<bool> use_bias;
  std::optional<std::int64_t> query_width, key_width, value_width;  // from build_config
  std::string source;  // "config.json" or "the MhaConfig given"
};

inline std::int64_t positive_integer(const KerasFile& file, const ConfigLayer& layer,
                                     const json& value, const char* key) {
  if (!value.is_number_integer() || value.get<std::int64_t>() <= 0 ||
      value.get<std::int64_t>() > kMaxLayerDimension)
    fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location, ".config.", key, " = ",
                      value.dump(), "; expected an integer in [1, 2^24]");
  return value.get<std::int64_t>();
}

[[noreturn]] inline void unsupported(const KerasFile& file, const ConfigLayer& layer,
                                     const std::string& key, const json& value, const char* why) {
  fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location, ".config.", key, " = ",
                    value.dump(), " is not supported: ", why);
}

// The last dimension of a build shape such as [null, 3, 5]; checks the rank sdmha computes.
inline std::optional<std::int64_t> build_width(const KerasFile& file, const ConfigLayer& layer,
                                               const json& shapes, const char* key) {
  const json* shape = member(shapes, key);
  if (!shape) return std::nullopt;
  if (!shape->is_array() || shape->size() != 3 || !shape->back().is_number_integer())
    unsupported(file, layer, std::string("build_config.shapes_dict.") + key, *shape,
                "sdmha takes (batch, steps, features) inputs");
  return positive_integer(file, layer, shape->back(), key);
}

inline void check_supported(const KerasFile& file, const ConfigLayer& layer, const json& config) {
  if (const json* axes = member(config, "attention_axes")) {
    const json first = axes->is_array() && axes->size() == 1 ? (*axes)[0] : *axes;
    if (!first.is_number_integer() ||
        (first.get<std::int64_t>() != 1 && first.get<std::int64_t>() != -2))
      unsupported(file, layer, "attention_axes", *axes, "sdmha attends over axis 1 only");
  }
  if (const json* gate = member(config, "use_gate"); gate && *gate != json(false))
    unsupported(file, layer, "use_gate", *gate, "sdmha has no gated attention");
  if (const json* window = member(config, "sliding_window"))
    unsupported(file, layer, "sliding_window", *window, "give sdmha an attention_mask instead");
  const json* dtype = member(config, "dtype");
  const json* policy = dtype && dtype->is_object() ? member(*dtype, "config") : nullptr;
  const json* policy_name = policy ? member(*policy, "name") : dtype;
  if (policy_name && policy_name->is_string() &&
      policy_name->get<std::string>().find("_from_") != std::string::npos)
    unsupported(file, layer, "dtype", *dtype, "quantized layers are not read");
}

inline Expected config_expectations(const KerasFile& file, const ConfigLayer& layer) {
  const json* config = member(*layer.entry, "config");
  if (!config || !config->is_object())
    fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location,
                      " has no 'config' object; expected MultiHeadAttention's configuration");
  Expected expected;
  expected.source = "config.json";
  auto required = [&](const char* key) {
    const json* value = member(*config, key);
    if (!value)
      fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location, ".config has no '",
                        key, "'; expected MultiHeadAttention's configuration");
    return positive_integer(file, layer, *value, key);
  };
  expected.heads = required("num_heads");
  expected.key_dim = required("key_dim");
  const json* value_dim = member(*config, "value_dim");
  expected.value_dim =
      value_dim ? positive_integer(file, layer, *value_dim, "value_dim") : *expected.key_dim;
  const json* use_bias = member(*config, "use_bias");
  if (use_bias && !use_bias->is_boolean())
    fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location,
                      ".config.use_bias = ", use_bias->dump(), "; expected true or false");
  expected.use_bias = use_bias ? use_bias->get<bool>() : true;
  expected.output_dim = 0;
  if (const json* output = member(*config, "output_shape")) {
    if (output->is_array() && output->size() > 1)
      unsupported(file, layer, "output_shape", *output, "sdmha's output is one vector per step");
    if (!output->is_array() || output->size() == 1)
      expected.output_dim = positive_integer(
          file, layer, output->is_array() ? (*output)[0] : *output, "output_shape");
  }
  check_supported(file, layer, *config);
  const json* build = member(*layer.entry, "build_config");
  const json* shapes = build ? member(*build, "shapes_dict") : nullptr;
  if (shapes && shapes->is_object()) {
    expected.query_width = build_width(file, layer, *shapes, "query_shape");
    expected.value_width = build_width(file, layer, *shapes, "value_shape");
    expected.key_width = build_width(file, layer, *shapes, "key_shape");
    if (!expected.key_width) expected.key_width = expected.value_width;  // key defaults to value
  }
  return expected;
}

inline Expected caller_expectations(const MhaConfig& config) {
  Expected expected;
  expected.source = "the MhaConfig given";
  expected.heads = config.num_heads;
  expected.key_dim = config.key_dim;
  expected.value_dim = config.resolved_value_dim();
  expected.output_dim = config.output_dim;
  expected.use_bias = config.use_bias;
  return expected;
}

// config.json and the caller's MhaConfig must agree where both speak; an output width of 0 (the
// query's width) is checked against the datasets instead.
inline void check_agreement(const std::string& file_name, Expected& file, const Expected& caller) {
  const std::pair<const char*, std::pair<std::optional<std::int64_t>, std::optional<std::int64_t>>>
      values[] = {{"num_heads", {file.heads, caller.heads}},
                  {"key_dim", {file.key_dim, caller.key_dim}},
                  {"value_dim", {file.value_dim, caller.value_dim}},
                  {"output_dim",
                   {file.output_dim != 0 && caller.output_dim != 0 ? file.output_dim : std::nullopt,
                    caller.output_dim}}};
  for (const auto& [key, pair] : values)
    if (pair.first && pair.second && *pair.first != *pair.second)
      fail<FormatError>(kWhere, "'", file_name, "': config.json gives ", key, " = ", *pair.first,
                        " but the MhaConfig given says ", *pair.second, " (0 = default)");
  if (file.use_bias && caller.use_bias && *file.use_bias != *caller.use_bias)
    fail<FormatError>(kWhere, "'", file_name,
                      "': config.json gives use_bias = ", *file.use_bias ? "true" : "false",
                      " but the MhaConfig given says ", *caller.use_bias ? "true" : "false");
  if (file.output_dim == 0 && caller.output_dim != 0) {
    file.output_dim = caller.output_dim;
    file.source = "config.json and the MhaConfig given";
  }
}

}  // namespace sdmha::detail::keras
