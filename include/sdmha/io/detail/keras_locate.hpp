// sdmha/io/detail/keras_locate.hpp — finding a MultiHeadAttention in a Keras file's HDF5 groups:
// by the name config.json gives it (and the group saving_lib derives from the layer tree), by the
// `name` attribute of `<layer>/vars` (Keras >= 3.6), or by an HDF5 group path; and listing every
// group that holds the four projections' variables.
//
// The group scan is bounded (kMaxGroupDepth levels, kMaxGroupsVisited groups), since a crafted
// file can hold hard links that revisit a group.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/hdf5.hpp"
#include "sdmha/io/detail/keras_archive.hpp"
#include "sdmha/io/detail/keras_config.hpp"
#include "sdmha/io/keras_layer.hpp"

namespace sdmha::detail::keras {

constexpr int kMaxGroupDepth = 64;  // HDF5 group levels searched
constexpr std::size_t kMaxGroupsVisited = 200000;

struct Sublayer {
  const char* keras_name;    // the EinsumDense's name
  const char* property;      // MultiHeadAttention's public property, the group since Keras 3.0.3
  const char* attribute;     // the private attribute, the group in Keras 3.0.0-3.0.2
  const char* kernel_shape;  // for messages
  const char* bias_shape;
};

constexpr Sublayer kSublayers[4] = {
    {"query", "query_dense", "_query_dense", "(Eq, num_heads, key_dim)", "(num_heads, key_dim)"},
    {"key", "key_dense", "_key_dense", "(Ek, num_heads, key_dim)", "(num_heads, key_dim)"},
    {"value", "value_dense", "_value_dense", "(Ev, num_heads, value_dim)",
     "(num_heads, value_dim)"},
    {"attention_output", "output_dense", "_output_dense", "(num_heads, value_dim, O)", "(O,)"}};

// `<layer>/query_dense/vars` or `<layer>/_query_dense/vars`; empty if neither is a group.
inline std::string sublayer_vars(const H5Source& source, const std::string& layer, int which) {
  for (const char* name : {kSublayers[which].property, kSublayers[which].attribute}) {
    const std::string vars = join_path(layer, std::string(name) + "/vars");
    if (is_group(source, vars)) return vars;
  }
  return std::string();
}

inline bool holds_attention(const H5Source& source, const std::string& layer) {
  for (int which = 0; which < 4; ++which)
    if (sublayer_vars(source, layer, which).empty()) return false;
  return true;
}

inline std::optional<std::string> group_name(const H5Source& source, const std::string& layer) {
  const H5Object vars = open_path(source, join_path(layer, "vars"));
  if (vars.kind != H5Kind::group) return std::nullopt;
  return string_attribute(vars.id.get(), "name");
}

// Every group that holds a MultiHeadAttention's sublayers, with its `name` attribute if any.
inline void scan_groups(const H5Source& source, hid_t group, const std::string& path, int depth,
                        std::size_t& visited, std::vector<io::KerasLayerInfo>& out) {
  if (++visited > kMaxGroupsVisited)
    fail<FormatError>(kWhere, "'", source.name, "' has more than ", kMaxGroupsVisited,
                      " groups (or links that revisit them); expected a Keras weights file");
  if (!path.empty() && holds_attention(source, path)) {
    out.push_back({group_name(source, path).value_or(std::string()), path});
    return;
  }
  if (depth >= kMaxGroupDepth) return;
  for (const std::string& name : link_names(source, group, path)) {
    if (name == "vars") continue;
    const H5Object child = open_child(source, group, path, name);
    if (child.kind == H5Kind::group)
      scan_groups(source, child.id.get(), join_path(path, name), depth + 1, visited, out);
  }
}

inline std::vector<io::KerasLayerInfo> scan_attention_groups(const H5Source& source) {
  const H5Object root = open_path(source, "");
  std::vector<io::KerasLayerInfo> found;
  std::size_t visited = 0;
  scan_groups(source, root.id.get(), "", 0, visited, found);
  return found;
}

struct Location {
  std::string name;
  std::string group;
  const json* entry = nullptr;  // the layer's config.json entry, when there is one
};

inline std::string describe(const std::vector<io::KerasLayerInfo>& layers) {
  std::string text;
  for (const auto& layer : layers)
    text += (text.empty() ? "" : ", ") +
            (layer.name.empty() ? std::string() : "'" + layer.name + "' at ") + "'" + layer.group +
            "'";
  return text.empty() ? std::string("(none)") : text;
}

// The group of a config.json layer in the weights file: its own, or, for files that Keras 2.13+
// wrote, the same with `_layer_checkpoint_dependencies` for `layers` (H5IOStore.get).
inline Location config_location(const KerasFile& file, const ConfigLayer& layer) {
  std::string group = layer.group;
  if (!holds_attention(file.h5, group)) {
    std::string legacy;
    for (const std::string& part : split_path(group))
      legacy = join_path(legacy, part == "layers" ? "_layer_checkpoint_dependencies" : part);
    if (!legacy.empty() && holds_attention(file.h5, legacy))
      group = legacy;
    else
      fail<FormatError>(kWhere, "'", file.h5.name, "': config.json places MultiHeadAttention '",
                        layer.name, "' at group '", group, "', which does not hold '", group,
                        "/query_dense/vars', '", group, "/key_dense/vars', '", group,
                        "/value_dense/vars' and '", group, "/output_dense/vars'");
  }
  const auto stored = group_name(file.h5, group);
  if (stored && *stored != layer.name)
    fail<FormatError>(kWhere, "'", file.h5.name, "': group '", group, "' is named '", *stored,
                      "' but config.json places '", layer.name, "' there");
  return {layer.name, group, layer.entry};
}

inline std::vector<io::KerasLayerInfo> attention_layers(const KerasFile& file,
                                                        const std::vector<ConfigLayer>& layers) {
  std::vector<io::KerasLayerInfo> found;
  for (const auto& layer : layers)
    if (layer.class_name == "MultiHeadAttention") found.push_back({layer.name, layer.group});
  return found.empty() ? scan_attention_groups(file.h5) : found;
}

// By the name config.json gives the layer.
inline std::optional<Location> by_config_name(const KerasFile& file,
                                              const std::vector<ConfigLayer>& layers,
                                              const std::string& layer_name) {
  std::vector<const ConfigLayer*> named, attention;
  for (const auto& layer : layers)
    if (layer.name == layer_name) named.push_back(&layer);
  for (const ConfigLayer* layer : named)
    if (layer->class_name == "MultiHeadAttention") attention.push_back(layer);
  if (attention.size() > 1)
    fail<FormatError>(kWhere, "'", file.config_name, "': several MultiHeadAttention layers are ",
                      "named '", layer_name, "' (at '", attention[0]->group, "' and '",
                      attention[1]->group, "'); expected one, or the group path as the name");
  if (attention.size() == 1) return config_location(file, *attention[0]);
  if (!named.empty())
    fail<FormatError>(kWhere, "'", file.config_name, "': layer '", layer_name, "' (",
                      named[0]->location, ") is a ", named[0]->class_name,
                      "; expected a MultiHeadAttention");
  return std::nullopt;
}

// By the `name` attribute of the groups (Keras >= 3.6), when config.json does not describe the
// attention layers (there is none, or the model is subclassed).
inline std::optional<Location> by_group_name(const KerasFile& file,
                                             const std::vector<ConfigLayer>& layers,
                                             const std::string& layer_name) {
  for (const auto& layer : layers)
    if (layer.class_name == "MultiHeadAttention") return std::nullopt;
  std::vector<io::KerasLayerInfo> found;
  for (const auto& layer : scan_attention_groups(file.h5))
    if (layer.name == layer_name) found.push_back(layer);
  if (found.size() > 1)
    fail<FormatError>(kWhere, "'", file.h5.name, "': several MultiHeadAttention groups are named '",
                      layer_name, "': ", describe(found), "; expected one, or the group path");
  if (found.empty()) return std::nullopt;
  return Location{found[0].name, found[0].group, nullptr};
}

// The layer at `group`, with its config.json entry when there is one.
inline Location at_group(const KerasFile& file, const std::vector<ConfigLayer>& layers,
                         const std::string& group) {
  for (const auto& layer : layers)
    if (layer.group == group && layer.class_name == "MultiHeadAttention")
      return config_location(file, layer);
  return {group_name(file.h5, group).value_or(std::string()), group, nullptr};
}

inline Location locate(const KerasFile& file, const std::string& layer_name) {
  const std::vector<ConfigLayer> layers = config_layers(file);
  // Keras refuses '/' in layer names (ops/operation.py, Operation.__init__): such a name is a path.
  if (!layer_name.empty() && layer_name.find('/') == std::string::npos) {
    if (auto found = by_config_name(file, layers, layer_name)) return *found;
    if (auto found = by_group_name(file, layers, layer_name)) return *found;
  }
  std::string group;
  for (const auto& part : split_path(layer_name)) group = join_path(group, part);
  if (!group.empty() && holds_attention(file.h5, group)) return at_group(file, layers, group);
  const std::vector<io::KerasLayerInfo> all = attention_layers(file, layers);
  if (layer_name.empty() && all.size() == 1) return at_group(file, layers, all[0].group);
  fail<FormatError>(kWhere, "'", file.config ? file.config_name : file.h5.name, "': ",
                    layer_name.empty()
                        ? std::string("no layer name given and the file holds ") +
                              std::to_string(all.size()) + " MultiHeadAttention layers"
                        : "no MultiHeadAttention layer named '" + layer_name + "'",
                    "; expected one of: ", describe(all), " (a layer name, or an HDF5 group path)");
}

}  // namespace sdmha::detail::keras
