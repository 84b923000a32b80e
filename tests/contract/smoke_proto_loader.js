// Polyglot smoke test: every OMA .proto loads in Node's @grpc/proto-loader and yields a
// gRPC service definition. Prints one JSON object: {service full name: [method names]}.
// Usage: node smoke_proto_loader.js PROTO_ROOT DEPS_ROOT
const path = require("path");
const fs = require("fs");
const protoLoader = require("@grpc/proto-loader");
const grpc = require("@grpc/grpc-js");

const [protoRoot, depsRoot] = process.argv.slice(2);
function findProtos(dir) {
  return fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) return findProtos(full);
    return entry.name.endsWith(".proto") ? [path.relative(protoRoot, full)] : [];
  });
}
const files = findProtos(path.join(protoRoot, "oma")).map((f) => f);
const definition = protoLoader.loadSync(files, {
  includeDirs: [protoRoot, depsRoot],
  keepCase: false,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
const loaded = grpc.loadPackageDefinition(definition);
const services = {};
for (const [name, value] of Object.entries(definition)) {
  if (value && typeof value === "object" && !("format" in value) && Object.values(value).some((m) => m && m.path)) {
    services[name] = Object.keys(value);
  }
}
if (!loaded.oma) throw new Error("package oma not found");
console.log(JSON.stringify({ files: files.length, services }));
